"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), in front of an ``AsyncLLM`` whose
engine core runs in its own process.

Request path (outermost first)::

    CORS (only with --allowed-origins; answers preflights itself, so they need no key)
     └ APIKeyMiddleware   401 unless "Authorization: Bearer KEY" or "x-api-key: KEY" (public:
                          /health, /version, the chat page's static files)
        └ BodySizeLimitMiddleware   413 before buffering an oversized body
           └ FastAPI routes   400 envelopes for every validation failure (errors.py)

Life cycle: bind the socket first (a taken port fails fast), start the engine core (model
load), then serve.  SIGTERM drains: new requests get 503 with ``Retry-After``, ``/health``
503, in-flight ones get ``--shutdown-timeout`` seconds, the rest are aborted, exit 0.
SIGINT or a second SIGTERM stops at once: in-flight requests end with a 503 error (an SSE
error event and ``[DONE]`` on streams), exit 0.  If the engine core dies,
in-flight requests get an error, ``/health`` turns 503 and the server exits with status 1
about a second later.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import logging
import os
import posixpath
import re
import signal
import socket
import sys
from types import FrameType
from typing import Any
from urllib.parse import unquote

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedllm.envs as envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.mp_client import EngineDeadError, EngineStartupError
from pagedllm.entrypoints.openai.chat_ui import UI_PATHS, add_chat_ui
from pagedllm.entrypoints.openai.errors import error_body, error_response, install_error_handlers
from pagedllm.entrypoints.openai.http_limits import (
    HTTPLimits,
    default_max_connections,
    limited_h11_protocol,
    raise_fd_limit,
)
from pagedllm.entrypoints.openai.json_body import StrictJSONRoute
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_base import (
    RETRY_AFTER_S,
    ServingState,
    engine_error_response,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.template_sandbox import TemplateSandbox
from pagedllm.entrypoints.openai.tokenizer_info import tokenizer_info
from pagedllm.gc_heap import freeze_gc_heap
from pagedllm.logger import uvicorn_log_config
from pagedllm.metrics import EngineMetrics, cache_config_labels
from pagedllm.model_files.safe_open import read_regular

logger = logging.getLogger("pagedllm.api_server")

# The chat page's static files are a shell without data; what it does needs the key.
PUBLIC_PATHS = frozenset({"/health", "/version", *UI_PATHS})


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # running from a source tree that is not installed
        return "0.1.0"


# ----------------------------------------------------------------------------- middleware


def normalize_path(path: str) -> str:
    """Canonical form for the auth decision: percent-decoded (repeatedly, so %252F does
    not survive), backslashes as slashes, ``//`` and dot segments collapsed, no trailing
    slash, lower case.  Only an exact public path skips auth, so any trick that changes
    the path can only make a request *need* the key, never skip it."""
    p = path
    for _ in range(3):
        p = unquote(p)
    # normpath keeps a leading "//" (POSIX allows it a meaning), so squeeze slashes first.
    p = posixpath.normpath(re.sub(r"/+", "/", "/" + p.replace("\\", "/")))
    return (p.rstrip("/") or "/").lower()


async def _send_json(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    resp = JSONResponse(body, status_code=status)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()]
    await send({"type": "http.response.start", "status": status,
                "headers": raw + (headers or [])})
    await send({"type": "http.response.body", "body": resp.body})


class APIKeyMiddleware:
    """401 for every path but ``PUBLIC_PATHS`` unless a configured key is presented as
    ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's
    SDKs send only this one).  Either header works on every route: one rule is simpler
    to reason about than a per-route one and grants nothing more (the key is the same).
    Keys are compared in constant time, every presented token against all of them (no
    early exit that would leak which one nearly matched)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _authorized(self, scope: Scope) -> bool:
        bearer, x_api_key = b"", b""
        seen: set[bytes] = set()
        for name, value in scope.get("headers", ()):
            if name in seen:  # the first of each header counts
                continue
            if name == b"authorization":
                seen.add(name)
                scheme, _, rest = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    bearer = rest.strip()
            elif name == b"x-api-key":
                seen.add(name)
                x_api_key = value.strip()
        ok = False
        for token in (bearer, x_api_key):
            for key in self.keys:
                ok |= hmac.compare_digest(token, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if normalize_path(scope.get("path", "/")) in PUBLIC_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _send_json(send, 401, error_body(
            "missing or invalid API key", status=401, code="invalid_api_key"),
            [(b"www-authenticate", b"Bearer")])


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for bodies over ``limit`` bytes: at once from ``Content-Length``, or as soon as
    a chunked body crosses the limit (the rest is never buffered)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        msg_413 = error_body(f"request body larger than {self.limit} bytes "
                             "(--max-request-body-bytes)", status=413)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False  # h11 rejects malformed lengths itself
                if too_big:
                    await _send_json(send, 413, msg_413, [(b"connection", b"close")])
                    return
        received = 0
        state = {"too_large": False, "started": False}

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    state["too_large"] = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if state["too_large"]:
                return  # the app is answering our exception; we answer 413 instead
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if state["too_large"] and not state["started"]:
            await _send_json(send, 413, msg_413, [(b"connection", b"close")])


# ----------------------------------------------------------------------------- app


def build_app(state: ServingState, *, api_keys: list[str] | None = None,
              allowed_origins: list[str] | None = None,
              max_body_bytes: int = 16 * 1024 * 1024, ui: bool = True) -> FastAPI:
    """The FastAPI application over ``state`` (routes, error handlers, middleware);
    ``ui`` adds the chat page at ``/`` (chat_ui.py)."""
    app = FastAPI(title="pagedllm OpenAI-compatible API", version=_version())
    # Every pydantic body is parsed by json_body.loads_strict (depth, NaN, surrogates).
    app.router.route_class = StrictJSONRoute
    app.state.serving = state
    install_error_handlers(app)
    completion = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    # /v1/messages (Anthropic) and /v1/responses (OpenAI Responses).
    from pagedllm.entrypoints.openai.extra_routes import add_extra_routes

    add_extra_routes(app, state, chat)
    # /v1/embeddings, /pooling, /score, /rerank (pooling models).
    from pagedllm.entrypoints.openai.serving_pooling import (
        OpenAIServingPooling,
        add_pooling_routes,
    )

    pooling = OpenAIServingPooling(state)
    add_pooling_routes(app, pooling)
    from pagedllm.entrypoints.openai.lora_routes import add_lora_routes

    add_lora_routes(app, state)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop makes progress (heartbeat), 503 otherwise."""
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": RETRY_AFTER_S})
        if not state.engine.is_healthy(state.heartbeat_timeout):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=name, root=name, max_model_len=state.max_model_len)
                 for name in state.served_model_names]
        if state.loras is not None:  # adapters, each a model with its base as parent
            cards += [ModelCard(id=name, root=r.lora_path, parent=r.base_model_name,
                                max_model_len=state.max_model_len)
                      for name, r in state.loras.by_name.items()]
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """One served model (OpenAI's retrieve); 404 naming it when it is not served."""
        try:
            state.check_model(model_id)
        except Exception as e:
            return engine_error_response(e)
        lora = state.lora_for(model_id)
        return JSONResponse(ModelCard(
            id=model_id, root=lora.lora_path if lora else model_id,
            parent=lora.base_model_name if lora else None,
            max_model_len=state.max_model_len).model_dump())

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> Response:
        """The tokenizer's configuration in vLLM's shape (tokenizer_info.py)."""
        if state.engine.tokenizer is None:
            return error_response("this server has no tokenizer", status=404,
                                  code="tokenizer_not_found")
        return JSONResponse(tokenizer_info(state.engine.tokenizer, state.chat_template,
                                           state.max_model_len))

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.set_engine_alive(state.engine.is_healthy(state.heartbeat_timeout))
        return Response(generate_latest(state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    # Handlers return Response objects (streams, envelopes); ``responses=`` documents the
    # success bodies in /openapi.json without re-validating every response.
    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        refused = pooling.refuse_generation()  # a pooling model: 400 naming its task
        if refused is not None:
            return refused
        return await completion.create_completion(body, raw_request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}})
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        refused = pooling.refuse_generation()
        if refused is not None:
            return refused
        return await chat.create_chat_completion(body, raw_request)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str) -> Response:
        """Cancel an in-flight request by its response id (``cmpl-…``/``chatcmpl-…``);
        it finishes with ``finish_reason: "abort"``."""
        if not state.cancel(request_id):
            return error_response(f"no in-flight request with id {request_id!r}",
                                  status=404, param="request_id", code="request_not_found")
        return JSONResponse({"id": request_id, "object": "request.cancelled",
                             "cancelled": True})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        try:
            state.check_unknown(body)
            state.check_model(body.model)
            ip = state.engine.input_processor
            if (body.prompt is None) == (body.messages is None):
                raise RequestError("give exactly one of prompt or messages", "prompt")
            tok = state.engine.tokenizer
            if tok is None:
                raise RequestError("this server has no tokenizer", "prompt")
            # Off the event loop: a big input must not stall other requests.
            if body.messages is not None:  # rendered as the chat endpoint renders it
                ids = await chat.render(body.chat_request())
            else:
                ids = await state.off_loop(ip.encode_text, body.prompt,
                                           add_special_tokens=body.add_special_tokens)
        except Exception as e:
            return engine_error_response(e)
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        try:
            state.check_unknown(body)
            state.check_model(body.model)
            bad = [t for t in body.tokens if t >= state.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of vocabulary "
                                   f"[0, {state.vocab_size})", "tokens")
            tok = state.engine.tokenizer
            if tok is None:
                raise RequestError("this server has no tokenizer", "tokens")
            text = await state.off_loop(tok.decode, body.tokens)
        except Exception as e:
            return engine_error_response(e)
        return JSONResponse({"prompt": text})

    if ui:
        add_chat_ui(app)
    # Added innermost first: the last one added runs first.
    app.add_middleware(BodySizeLimitMiddleware, limit=max_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_methods=["*"], allow_headers=["*"],
                           allow_credentials=False)
    return app


# ----------------------------------------------------------------------------- serving


class _Server(uvicorn.Server):
    """uvicorn with our SIGTERM semantics: drain (503 to new requests) for up to
    ``shutdown_timeout`` seconds, abort the rest, exit 0.  A second signal or SIGINT stops
    at once.  ``exit_code`` becomes 1 when the engine core died."""

    def __init__(self, config: uvicorn.Config, state: ServingState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn we do not re-raise the signal after shutdown: our exit status
        # is the contract (0 after a drain, 1 after an engine failure).
        if self.loop is None:
            self.should_exit = True
            return
        if sig == signal.SIGTERM and not self.state.draining:
            self.loop.call_soon_threadsafe(self._spawn, self._drain())
            return
        if self._stopping:  # a third signal: stop waiting for anything
            self.force_exit = self.should_exit = True
            return
        self._stopping = True
        self.loop.call_soon_threadsafe(self._spawn, self._stop_now())

    async def _stop_now(self) -> None:
        """SIGINT, or a second SIGTERM: end every in-flight request at once with a 503
        error (streams get an SSE error event and ``[DONE]``, others a JSON envelope),
        give the handlers a moment to send it, then shut down."""
        st = self.state
        st.draining = True
        count = st.fail_all(RequestError(
            "the server is shutting down", status=503, err_type="service_unavailable_error",
            headers={"Retry-After": RETRY_AFTER_S}))
        logger.warning("stopping now: ended %d in-flight request(s)", count)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while st.active_requests and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        st = self.state
        st.draining = True
        loop = asyncio.get_running_loop()
        logger.info("SIGTERM: no longer admitting; draining %d in-flight request(s) for "
                    "up to %.1f s", st.active_requests, self.shutdown_timeout)
        deadline = loop.time() + self.shutdown_timeout
        while st.active_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if st.active_requests:
            logger.warning("shutdown timeout: aborting %d request(s)", st.active_requests)
            for public_id in list(st.public_ids):
                st.cancel(public_id)
            end = loop.time() + 5.0
            while st.active_requests and loop.time() < end:
                await asyncio.sleep(0.05)
        logger.info("drained; shutting down")
        self.should_exit = True

    def engine_died(self, error: EngineDeadError) -> None:
        logger.error("engine core is dead (%s); the server exits", error)
        self.exit_code = 1
        if self.loop is not None:
            # A moment for in-flight error responses to flush; /health says 503 meanwhile.
            self.loop.call_later(1.0, setattr, self, "should_exit", True)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on accepted sockets whose proto says TCP.  With Nagle on, a
    # streamed chunk written while the previous one is unacknowledged waits for the
    # client's delayed ACK: up to 40 ms added to a first token or an inter-token gap.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


CHAT_TEMPLATE_MAX_BYTES = 4 << 20


def _load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):  # a regular file, read with a size cap
        return read_regular(value, max_bytes=CHAT_TEMPLATE_MAX_BYTES)
    if "{" not in value:
        raise ValueError(f"chat-template: {value} is neither a file nor a Jinja template")
    return value


async def _prepare(args: argparse.Namespace, engine: AsyncLLM, sock: socket.socket,
                   names: list[str] | None, chat_template: str | None,
                   api_keys: list[str], max_pending: int | None) -> tuple[_Server, ServingState]:
    """Everything between the engine's start and serving: metrics, the serving state,
    LoRA modules, tool support, images, the app and its uvicorn server; logs what the
    server decided.  Raises ``ValueError`` with a one-line reason on bad flags; the
    caller shuts the engine down on any failure."""
    config = engine.config
    mc = config.model_config
    names = names or [mc.served_model_name]
    ready = engine.ready
    metrics = EngineMetrics(names[0], max_model_len=ready.max_model_len or mc.max_model_len,
                            cache_info=cache_config_labels(config.cache_config,
                                                           ready.num_blocks),
                            speculative=config.scheduler_config.speculative_config is not None)
    engine.attach_metrics(metrics)
    metrics.set_engine_alive(True)
    state = ServingState(
        engine=engine, metrics=metrics, served_model_names=names,
        max_model_len=ready.max_model_len or mc.max_model_len, max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_inputs_per_request=getattr(args, "max_inputs_per_request", 2048),
        allow_unknown_fields=args.allow_unknown_fields,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template=chat_template, heartbeat_timeout=args.health_heartbeat_timeout,
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None))
    if config.lora_config is not None:
        from pagedllm.entrypoints.openai.lora_routes import ServerLoRAs

        state.loras = ServerLoRAs(True, names[0])
        for m in getattr(args, "lora_modules", None) or ():
            try:
                state.loras.add(m["name"], m["path"], engine.input_processor.loras.check,
                                names, m.get("base_model_name"))
            except ValueError as e:
                raise ValueError(f"--lora-modules: {e}") from None
    state.grammar_check_timeout = getattr(args, "structured_outputs_check_timeout", 10.0)
    _detect_tool_support(state, args, mc)
    if args.enable_log_requests:
        from pagedllm.entrypoints.openai.request_logger import RequestLogger

        state.request_logger = RequestLogger(args.max_log_len)
    from pagedllm.entrypoints.openai.chat_images import from_args as images_from_args

    state.images = images_from_args(args, config)
    if args.trust_request_chat_template:
        # Client templates render in a bounded child process; start it now (~1 s).
        state.template_sandbox = TemplateSandbox(max_chars=args.max_request_body_bytes)
        await state.template_sandbox.start()
    app = build_app(state, api_keys=api_keys, allowed_origins=args.allowed_origins,
                    max_body_bytes=args.max_request_body_bytes, ui=not args.no_ui)
    fd_limit = raise_fd_limit()
    limits = HTTPLimits(
        max_header_bytes=args.h11_max_incomplete_event_size,
        max_header_count=args.h11_max_header_count,
        header_timeout=args.header_read_timeout,
        body_timeout=args.body_read_timeout,
        max_connections=args.max_connections or default_max_connections(fd_limit))
    access_log = not args.disable_uvicorn_access_log
    # h11 even where httptools is installed: h11 (with http_limits on top) bounds the
    # request head, httptools does not, and it measured no faster here.  h11's own
    # buffer limit sits above ours so that ours answers first (431, not h11's 400).
    # log_level=None: the log config sets the levels (uvicorn would otherwise set its
    # access logger to --uvicorn-log-level, silencing it below "info").
    uv_config = uvicorn.Config(app, http=limited_h11_protocol(limits),
                               h11_max_incomplete_event_size=limits.max_header_bytes + 65536,
                               timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]
                               log_level=None,
                               timeout_graceful_shutdown=5, lifespan="off",
                               access_log=access_log,
                               log_config=uvicorn_log_config(args.uvicorn_log_level,
                                                             access_log))
    server = _Server(uv_config, state, args.shutdown_timeout)
    engine.on_dead.append(server.engine_died)
    kv_tokens = max(ready.num_blocks - 1, 0) * ready.block_size
    host, port = sock.getsockname()[:2]
    logger.info("model %s (served as %s), dtype %s, device %s; engine core pid %s",
                mc.resolved.display_name, ", ".join(names), ready.dtype, ready.device,
                ready.pid)
    if mc.runner == "pooling":  # one forward per input, nothing kept between steps
        kv = f"pooling model, no KV cache; max_model_len {state.max_model_len}"
    else:
        kv = (f"KV cache {ready.num_blocks - 1} blocks x {ready.block_size} tokens = "
              f"{kv_tokens} tokens; max_model_len {state.max_model_len}; max concurrency "
              f"at max_model_len {kv_tokens / max(state.max_model_len, 1):.2f}x")
    logger.info("%s; max_num_seqs %d; admission limit %s; auth %s; CORS %s", kv,
                ready.max_num_seqs, "none" if max_pending is None else f"{max_pending} seqs",
                "on" if api_keys else "off", args.allowed_origins or "off")
    # Starlette's streaming response opens an anyio task group, and anyio imports its
    # asyncio backend on first use: ~0.3 s that would stall the event loop -- every
    # stream in flight -- at the first streamed request.  Pay it before serving.
    async with anyio.create_task_group():
        pass
    freeze_gc_heap("API server")
    url_host = f"[{host}]" if ":" in host else host
    logger.info("Serving on http://%s:%d (Ctrl-C to stop)", url_host, port)
    logger.info("HTTP limits: head %d bytes / %d fields, header read %.0f s, keep-alive "
                "%.0f s, %d connections (open-files limit %d)", limits.max_header_bytes,
                limits.max_header_count, limits.header_timeout, args.timeout_keep_alive,
                limits.max_connections, fd_limit)
    return server, state


async def _serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.arg_utils import check_dtype_on_device
    from pagedllm.entrypoints.engine_cli_args import engine_args_from_cli

    names: list[str] | None = args.served_model_name
    engine_args = engine_args_from_cli(args)
    engine_args = dataclasses.replace(engine_args,
                                      served_model_name=names[0] if names else None)
    chat_template = _load_chat_template(args.chat_template)
    api_keys = list(args.api_key or [])
    if not api_keys and envs.api_key():
        api_keys = [envs.api_key()]
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        raise ValueError(f"port: cannot listen on {args.host}:{args.port}: "
                         f"{e.strerror or e}") from None
    # Before spawning the engine core: an impossible dtype is refused at once.
    check_dtype_on_device(engine_args.dtype, engine_args.device)
    max_pending = (None if args.max_num_queued_requests is None
                   else args.max_num_seqs + args.max_num_queued_requests)
    try:
        # From the arguments: the engine core starts while this process builds its config.
        engine = await AsyncLLM.create(engine_args, max_pending_seqs=max_pending,
                                       max_logprobs=args.max_logprobs,
                                       transport=args.engine_transport)
    except EngineStartupError as e:
        sock.close()
        raise ValueError(f"engine core failed to start: {e}") from None
    except BaseException:
        sock.close()
        raise
    try:
        server, state = await _prepare(args, engine, sock, names, chat_template, api_keys,
                                       max_pending)
    except BaseException:
        # Whatever fails between the engine's start and serving (a bad --lora-modules, a
        # broken optional dependency) must not leave the engine core running: the
        # process would hang after printing its error instead of exiting.
        await engine.shutdown()
        sock.close()
        raise
    try:
        await server.serve(sockets=[sock])
    finally:
        if state.template_sandbox is not None:
            await state.template_sandbox.close()
        if state.grammar_checker is not None:
            await state.grammar_checker.close()
        if state.images is not None:
            state.images.close()
        await engine.shutdown()
        sock.close()
    logger.info("server stopped (exit status %d)", server.exit_code)
    return server.exit_code


def _detect_tool_support(state: ServingState, args: argparse.Namespace, mc: Any) -> None:
    """Set the state's tool parser, auto tool choice and prompt fallback from the flags
    and the effective chat template (tool_detection.py); log the decision."""
    from pagedllm.entrypoints.openai.tool_detection import resolve

    template = state.chat_template
    if template is None:
        template = getattr(state.engine.tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None  # a dict of named templates: detection reads only a single one
    hf = getattr(mc, "hf_config", None)
    support = resolve(getattr(args, "tool_call_parser", None),
                      getattr(args, "enable_auto_tool_choice", False), template,
                      getattr(hf, "model_type", None))
    state.tool_call_parser = support.parser
    state.enable_auto_tool_choice = support.auto
    state.tool_prompt_fallback = support.prompt_fallback
    if support.prompt_fallback:
        # xgrammar builds the call grammars; it takes seconds to import, so not on the
        # event loop at the first request with tools.
        try:
            import xgrammar  # noqa: F401
        except ImportError as e:
            raise ValueError(f"tool calls need xgrammar, which cannot be imported ({e}): "
                             "reinstall pagedllm's dependencies, or pass "
                             "--tool-call-parser none") from None
    logger.info("%s", support.summary)


def run_server(args: argparse.Namespace) -> int:
    """``pagedllm serve``: run until SIGTERM/SIGINT or engine death; returns the exit
    status.  User errors (bad model path, taken port, too little KV memory) raise
    ``ValueError`` with a one-line reason (the CLI prints it and exits 1)."""
    from pagedllm.entrypoints.prefetch import prefetch_startup_files
    from pagedllm.logger import init_logger

    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser == "none":
        raise ValueError("--enable-auto-tool-choice contradicts --tool-call-parser none")
    prefetch_startup_files()  # first thing: both processes are about to import torch
    init_logger()
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.openai.cli_args import build_parser

    args = build_parser().parse_args(argv)
    try:
        return run_server(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
