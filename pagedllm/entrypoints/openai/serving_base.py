"""What the completion and chat handlers share: the server's state, request admission,
error mapping, SSE framing, stream merging and disconnect handling.

Request ids: the response ``id`` (``cmpl-…``/``chatcmpl-…``) is the public id; it is
built from the ``X-Request-Id`` header or the ``request_id`` field when given, random
otherwise.  One HTTP request may run several engine requests (a completion with a list of
prompts): ``ServingState.public_ids`` maps the public id to them, so
``POST /v1/requests/{id}/cancel`` cancels them all.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from pagedllm.engine.input_processor import ContextLengthError, PromptType
from pagedllm.entrypoints.openai.errors import error_response, request_error_response
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.template_sandbox import TemplateSandbox
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


@dataclass
class ServingState:
    """Mutable server-wide state, owned by the app (one per server, no globals)."""

    engine: AsyncLLM
    metrics: EngineMetrics
    served_model_names: list[str]
    max_model_len: int
    max_n: int = 16
    max_logprobs: int = 20
    # --max-inputs-per-request: prompts / inputs / documents in one request body.
    max_inputs_per_request: int = 2048
    allow_unknown_fields: bool = False
    trust_request_chat_template: bool = False
    chat_template: str | None = None
    heartbeat_timeout: float = 10.0
    draining: bool = False
    # HTTP requests currently generating (the SIGTERM drain waits for them).
    active_requests: int = 0
    public_ids: dict[str, list[str]] = field(default_factory=dict)
    # Renders client-supplied chat templates (only with --trust-request-chat-template).
    template_sandbox: TemplateSandbox | None = None
    tokenizer_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="pagedllm-tokenizer"))
    _admission: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # Tools and reasoning (--enable-auto-tool-choice, --tool-call-parser,
    # --reasoning-parser; entrypoints/openai/chat_tools.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # The tools go into the system prompt, calls grammar-guided (tool_detection.py).
    tool_prompt_fallback: bool = False
    reasoning_parser: str | None = None
    # LoRA adapters served as models (lora_routes.ServerLoRAs), None: LoRA off.
    loras: Any = None
    # --enable-log-requests (request_logger.py); None: requests are not logged.
    request_logger: Any = None
    # Images in chat requests (chat_images.ChatImages: the media flags, the model's
    # image support and --limit-mm-per-prompt); made at first use if not at start-up.
    images: Any = None
    # Parses and test-compiles constraints in worker processes, bounded in time and
    # size (structured_output/checker.py); made at the first structured request.
    grammar_checker: Any = None
    grammar_check_timeout: float = 10.0  # --structured-outputs-check-timeout

    def tool_parser_obj(self) -> Any:
        if self.tool_call_parser is None:
            return None
        from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

        return get_tool_parser(self.tool_call_parser)

    def reasoning_parser_obj(self) -> Any:
        if self.reasoning_parser is None:
            return None
        from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        return get_reasoning_parser(self.reasoning_parser)

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def checker(self) -> Any:
        """The grammar checker (``structured_output.checker.GrammarChecker``) for this
        model's vocabulary; from now on the engine's input processor leaves grammar
        parsing to it."""
        if self.grammar_checker is None:
            from pagedllm.structured_output.checker import GrammarChecker

            tok, vocab = self.engine.tokenizer, self.vocab_size

            def info() -> str | None:
                if tok is None:
                    return None
                from pagedllm.structured_output.backend import tokenizer_info

                return str(tokenizer_info(tok, vocab).serialize_json())

            self.grammar_checker = GrammarChecker(info,
                                                  timeout=self.grammar_check_timeout)
            self.engine.input_processor.check_grammars = False
        return self.grammar_checker

    def sandbox(self) -> TemplateSandbox:
        """The sandbox for request chat templates (made at first use unless the server
        made it at start-up)."""
        if self.template_sandbox is None:
            self.template_sandbox = TemplateSandbox()
        return self.template_sandbox

    def lora_for(self, model: str | None) -> Any:
        """The ``LoRARequest`` a request's ``model`` names (None: the base model)."""
        return self.loras.get(model) if self.loras is not None else None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names \
                and self.lora_for(model) is None:
            raise RequestError(f"The model `{model}` does not exist.", "model", status=404,
                               code="model_not_found", err_type="NotFoundError")

    def check_unknown(self, body: Any) -> None:
        """400 naming fields that are neither OpenAI's nor our documented extras."""
        if self.allow_unknown_fields:
            return
        extra = sorted(getattr(body, "model_extra", None) or {})
        if extra:
            raise RequestError(
                f"Unrecognized request argument(s): {', '.join(extra)} (start the server "
                "with --allow-unknown-fields to ignore unknown fields)", extra[0])

    def check_admitting(self) -> None:
        if self.draining:
            self.metrics.record_rejected("draining")
            raise RequestError("the server is shutting down", status=503,
                               err_type="service_unavailable_error",
                               headers={"Retry-After": RETRY_AFTER_S})
        if self.engine.dead is not None:
            raise RequestError("the engine is not running", status=503,
                               err_type="service_unavailable_error")

    def public_id(self, raw_request: Request, prefix: str, field_id: str | None) -> str:
        base = raw_request.headers.get("x-request-id") or field_id or uuid.uuid4().hex
        if len(base) > 256:
            raise RequestError("request id is longer than 256 characters", "request_id")
        pid = f"{prefix}-{base}"
        if pid in self.public_ids:
            raise RequestError(f"request id {pid!r} is already in use", "request_id")
        return pid

    def _check_capacity(self, need: int) -> None:
        engine = self.engine
        if (engine.max_pending_seqs is not None
                and engine.num_pending_seqs + need > engine.max_pending_seqs):
            self.metrics.record_rejected("queue_full")
            raise EngineOverloadedError("the server is at capacity; retry later")

    def check_num_inputs(self, n: int, param: str) -> None:
        """400 naming ``param`` and the cap when a body holds more than
        ``--max-inputs-per-request`` inputs (checked before any is tokenised)."""
        cap = self.max_inputs_per_request
        if n > cap:
            raise RequestError(f"{param} holds {n} inputs; at most {cap} per request "
                               "(--max-inputs-per-request)", param)

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the tokenizer thread (one thread: HF tokenizers
        are not safe to call concurrently), so the event loop keeps serving."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    async def _prepare(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """Text prompts tokenised off the event loop (a 10 MB prompt takes seconds)."""
        if isinstance(prompt, str) and prompt and self.engine.tokenizer is not None:
            ids = await self.off_loop(self.engine.input_processor.encode_text, prompt,
                                      add_special_tokens=add_special_tokens)
            return {"prompt": prompt, "prompt_token_ids": ids}
        return prompt

    async def start(self, public_id: str, prompts: list[PromptType],
                    params: SamplingParams | PoolingParams, priority: int,
                    add_special_tokens: bool = True,
                    model: str | None = None,
                    raw_request: Request | None = None) -> list[RequestStream]:
        """Tokenise, validate, admit and queue one engine request per prompt.

        Admission is all or nothing for the whole request (every prompt times ``n``):
        checked before tokenising (a full server refuses at once) and again, atomically
        with queueing every prompt, under ``_admission``.  With ``raw_request``,
        tokenising stops (499) once its client has gone."""
        need = len(prompts) * getattr(params, "n", 1)  # PoolingParams: one sequence
        self._check_capacity(need)
        so = getattr(params, "structured_outputs", None)
        if so is not None:  # parse and compile off the loop, bounded (400 / 499)
            from pagedllm.entrypoints.openai.structured import checked

            await checked(self.checker(), so,
                          raw_request.is_disconnected if raw_request is not None else None)
        ready = []
        for i, p in enumerate(prompts):
            if (raw_request is not None and i and i % 16 == 0
                    and await raw_request.is_disconnected()):
                raise RequestError("the client disconnected", status=499)
            ready.append(await self._prepare(p, add_special_tokens))
        ids = [public_id] if len(prompts) == 1 else [f"{public_id}-{i}"
                                                      for i in range(len(prompts))]
        streams: list[RequestStream] = []
        async with self._admission:
            self.check_admitting()  # the server may have started draining meanwhile
            if public_id in self.public_ids:  # taken while this one was tokenising
                raise RequestError(f"request id {public_id!r} is already in use",
                                   "request_id")
            self._check_capacity(need)
            try:
                for rid, prompt in zip(ids, ready):
                    streams.append(await self.engine.add_request(
                        prompt, params, rid, priority,
                        lora_request=self.lora_for(model)))
            except BaseException:
                for s in streams:
                    s.close()
                raise
        self.public_ids[public_id] = ids
        self.active_requests += 1
        if self.request_logger is not None:
            for rid, prompt in zip(ids, ready):
                self.request_logger.log(rid, prompt, params)
        return streams

    def finish(self, public_id: str, streams: list[RequestStream]) -> None:
        """Release a request (idempotent); aborts whatever is still generating."""
        for s in streams:
            s.close()
        if self.public_ids.pop(public_id, None) is not None:
            self.active_requests -= 1

    def fail_all(self, error: BaseException) -> int:
        """End every in-flight request with ``error`` (streams: an SSE error event, then
        ``[DONE]``; others: the error's JSON envelope).  Returns how many."""
        count = 0
        for ids in list(self.public_ids.values()):
            count += 1
            for rid in ids:
                self.engine.fail(rid, error)
        return count

    def cancel(self, public_id: str) -> bool:
        ids = self.public_ids.get(public_id)
        if ids is None:
            return False
        for rid in ids:
            self.engine.abort(rid)
        return True


class ServingHandler:
    """What every endpoint handler shares: the server state and its tokenizer."""

    def __init__(self, state: ServingState) -> None:
        self.state = state

    @property
    def tokenizer(self) -> Any:
        return self.state.engine.tokenizer


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_error_response(e: BaseException) -> JSONResponse:
    """Map an exception raised while starting or running a request to an envelope."""
    if isinstance(e, RequestError):
        return request_error_response(e)
    if isinstance(e, ContextLengthError):
        return error_response(str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, EngineOverloadedError):
        return error_response(str(e), status=503, err_type="service_unavailable_error",
                              headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, EngineDeadError):
        return error_response(str(e), status=500, err_type="server_error",
                              code="engine_dead")
    if isinstance(e, ValueError):
        msg = str(e).splitlines()[0] if str(e) else "invalid request"
        return error_response(msg, param=_param_of(msg))
    logger.exception("unexpected error while serving a request", exc_info=e)
    return error_response("internal server error", status=500, err_type="server_error")


_PARAMS = ("prompt", "messages", "max_tokens", "logprobs", "prompt_logprobs", "n", "stop",
           "temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "logit_bias",
           "stop_token_ids", "priority", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "model", "input", "dimensions", "normalize", "text_1",
           "text_2", "query", "documents", "top_n", "task", "token_type_ids")


def _param_of(message: str) -> str | None:
    """The parameter a ``ValueError`` names (its first word, by project convention)."""
    head = message.split(" ", 1)[0].rstrip(":")
    if head in _PARAMS:
        return head
    if "token id" in message or "prompt" in message:
        return "prompt"
    return None


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event.  msgspec encodes the dict (UTF-8, no ASCII escapes, as
    ``json.dumps(ensure_ascii=False)`` but several times faster: this runs once per
    streamed token per request)."""
    payload = data.encode() if isinstance(data, str) else _json_encode(data)
    return b"data: " + payload + b"\n\n"


_json_encode = msgspec.json.Encoder().encode

SSE_DONE = b"data: [DONE]\n\n"


def sse_error(e: BaseException) -> bytes:
    resp = engine_error_response(e)
    return sse(resp.body.decode())


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as outputs arrive: yields (stream index, output).

    One stream (the common case) is iterated directly, without helper tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # delivered to the consumer, which re-raises
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def listen_for_disconnect(raw_request: Request) -> None:
    """Returns when the client disconnects (the body has already been read)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(raw_request: Request,
                            handler: Callable[[], Awaitable[Response]]) -> Response:
    """Run a non-streaming handler, cancelling it if the client disconnects (so its
    engine requests are aborted and their KV blocks freed at the next step)."""
    work = asyncio.ensure_future(handler())
    watch = asyncio.ensure_future(listen_for_disconnect(raw_request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        pass
    # Nobody is listening; the status is for the access log only.
    return Response(status_code=499)


def token_text(lp: Logprob, tid: int, tokenizer: Any) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else str(tid)


def logprob_value(v: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM uses -9999.0 too).
    return max(v, -9999.0)
