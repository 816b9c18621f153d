"""Flags of ``pagedllm serve`` (vLLM's names where vLLM has the flag).

``add_serve_args`` adds the engine flags (shared with ``generate``/``chat``) and the
server's own; ``api_server.run_server`` consumes the namespace.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.entrypoints.engine_cli_args import add_engine_args


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every ``pagedllm serve`` flag, each with a help text."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to bind. Default 127.0.0.1 (loopback only); use 0.0.0.0 "
                        "to listen on every interface.")
    g.add_argument("--port", type=int, default=8000,
                   help="TCP port to listen on (0 = any free port; the log says which).")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) clients must use in the 'model' field. Default: "
                        "the model's name. The first is reported in responses.")
    g.add_argument("--api-key", action="append", default=None,
                   help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', as "
                        "Anthropic's SDKs send) on every route except /health and "
                        "/version (repeatable; also $PAGEDLLM_API_KEY).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions: a Jinja file path or the "
                        "template text. Default: the model's own.")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Allow clients to send their own 'chat_template' (refused by "
                        "default: a template is code).")
    g.add_argument("--max-num-queued-requests", type=_non_negative_int, default=None,
                   help="Admission control: at most max-num-seqs + this many sequences in "
                        "flight; beyond it requests get 503 with Retry-After. An n>1 "
                        "request is admitted all-or-nothing. Default: unlimited.")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="On SIGTERM: stop admitting (503), let in-flight requests finish "
                        "for up to this many seconds, then abort the rest and exit.")
    g.add_argument("--max-logprobs", type=_non_negative_int, default=20,
                   help="Largest 'logprobs' / 'top_logprobs' / 'prompt_logprobs' a "
                        "request may ask for.")
    g.add_argument("--max-n", type=int, default=16,
                   help="Largest 'n' (samples per prompt) a request may ask for.")
    g.add_argument("--max-inputs-per-request", type=_positive_int, default=2048,
                   help="Most prompts / inputs / documents one request may hold "
                        "(/v1/completions, /v1/embeddings, /pooling, /score, /rerank); "
                        "more get 400 before any is tokenised.")
    g.add_argument("--structured-outputs-check-timeout", type=float, default=10.0,
                   help="Seconds a request's grammar / JSON schema may take to parse and "
                        "compile (in a worker process, off the event loop); longer "
                        "gets 400 naming the limit.")
    g.add_argument("--allowed-origins", nargs="*", default=None,
                   help="CORS: origins allowed to call the API from a browser ('*' for "
                        "any). Default: CORS off.")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="Ignore request fields that are neither OpenAI's nor documented "
                        "extras, instead of answering 400 naming them.")
    g.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="Larger request bodies get 413 (checked before buffering them). "
                        "Parsing and validating a JSON body holds the interpreter lock "
                        "wherever it runs (about 0.3 s per MB of token ids), so this "
                        "also bounds how long one body can stall the server.")
    g.add_argument("--health-heartbeat-timeout", type=_positive_float, default=30.0,
                   help="/health answers 503 when the engine loop sent nothing for this "
                        "many seconds (it sends a heartbeat every 0.5 s when idle and an "
                        "update every step).")
    g.add_argument("--engine-transport", choices=["ipc", "tcp"], default="ipc",
                   help="How the API server talks to the engine-core process: ipc "
                        "(a private Unix socket directory) or tcp (127.0.0.1, random "
                        "ports).")
    # Connection-level limits (http_limits.py; docs/server.md, "Limits").
    g.add_argument("--h11-max-incomplete-event-size", type=_positive_int, default=16 * 1024,
                   help="Largest request head (request line + headers) in bytes; a "
                        "larger one gets 431 at once.")
    g.add_argument("--h11-max-header-count", type=_positive_int, default=256,
                   help="Most header fields in a request; more get 431.")
    g.add_argument("--header-read-timeout", type=_positive_float, default=10.0,
                   help="Seconds a client has to send a complete request head (from "
                        "connecting, or from its first byte on a kept-alive connection); "
                        "then 408 and close (bounds slowloris clients).")
    g.add_argument("--body-read-timeout", type=_positive_float, default=30.0,
                   help="Seconds a client has, after its request head, to send the whole "
                        "body (more for a big Content-Length: 64 KiB/s); then 408 and "
                        "close (bounds clients that trickle or withhold a body).")
    g.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0,
                   help="Seconds an idle kept-alive connection stays open.")
    g.add_argument("--max-connections", type=_positive_int, default=None,
                   help="Most open client connections. A new one beyond it evicts the "
                        "oldest connection not serving a request (idle, or still sending "
                        "its head), else gets 503. Default: the open-files limit (raised "
                        "to its hard limit at start-up) minus 256.")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (its errors and warnings).")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="Log each request at INFO as it is queued: its id, sampling "
                        "params, prompt length and token ids (off by default: prompts "
                        "may hold private data).")
    g.add_argument("--max-log-len", type=_positive_int, default=None,
                   help="With --enable-log-requests, log at most this many prompt "
                        "characters and token ids (default: all).")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="Do not log one line per HTTP request (client, request line, "
                        "status); the access log is on by default, as in vLLM.")
    g.add_argument("--no-ui", action="store_true",
                   help="Do not serve the chat page at / (it is on by default).")
    add_lora_server_args(g)
    add_image_server_args(parser.add_argument_group("images"))
    t = parser.add_argument_group("tools and reasoning")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Allow tool_choice 'auto' (the default when a request has tools) "
                        "with --tool-call-parser; without a parser it is detected.")
    t.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "none"],
                   help="How tool calls look in this model's output: hermes (Qwen, "
                        "<tool_call> blocks), llama3_json, mistral ([TOOL_CALLS]); "
                        "'none' turns tool_choice 'auto' off. Default: detected from the "
                        "chat template, else tools go into the system prompt "
                        "(docs/server.md, tool calling).")
    t.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="Split <think> reasoning into 'reasoning_content' (structured "
                        "outputs then apply after the reasoning).")
    add_engine_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm serve",
        description="Start the OpenAI-compatible HTTP server (engine core in its own "
                    "process).")
    add_serve_args(parser)
    return parser


def lora_module(text: str) -> dict[str, Any]:
    """argparse type for one ``--lora-modules`` entry: ``name=path`` or a JSON object."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(
                f'a JSON entry needs string "name" and "path", got {text!r}')
        return {k: value[k] for k in ("name", "path", "base_model_name") if k in value}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return {"name": name, "path": path}


def add_image_server_args(g: Any) -> None:
    """Bounds on the images chat requests name (docs/server.md, "Images")."""
    from pagedllm.multimodal import media

    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="Allow file:// image URLs, only for regular files under DIR "
                        "(symlinks and '..' resolved first). Default: file:// refused.")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="Fetch http(s) image URLs (and their redirects) only from these "
                        "hosts. Default: any host.")
    g.add_argument("--media-fetch-timeout", type=_positive_float,
                   default=media.DEFAULT_FETCH_TIMEOUT_S, metavar="SECONDS",
                   help="Seconds to fetch one http(s) image, redirects and body included "
                        "(vLLM's VLLM_IMAGE_FETCH_TIMEOUT); slower is a 400.")
    g.add_argument("--max-image-bytes", type=_positive_int,
                   default=media.DEFAULT_MAX_IMAGE_BYTES,
                   help="Largest encoded image (data URL, download or file) in bytes; a "
                        "download is cut off once past it. Default 20 MiB.")
    g.add_argument("--max-image-pixels", type=_positive_int,
                   default=media.DEFAULT_MAX_IMAGE_PIXELS,
                   help="Largest image in pixels (width x height), read from its header "
                        "before decoding (decompression bombs). Default 33554432.")
    g.add_argument("--max-image-pixels-per-request", type=_positive_int,
                   default=media.DEFAULT_MAX_REQUEST_PIXELS,
                   help="Most pixels all of one request's images may hold together "
                        "(checked from each header before decoding). Default 67108864.")


def add_lora_server_args(g: Any) -> None:
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora): name=path or "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'. '
                        "Requests choose one by its name in 'model'.")
