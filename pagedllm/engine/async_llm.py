"""AsyncLLM: the asyncio engine behind the API server.

::

    generate() ── InputProcessor.process ──► AsyncMPClient.add_requests ──► core process
        ▲                                                                      │
        │ per-request _OutputStream (DELTA RequestOutputs, or an exception)    │
        └── OutputProcessor.process_outputs ◄── output loop task ◄─────────────┘

Contract:

* ``add_request(prompt, params, request_id)`` validates, admits and queues a request and
  returns its ``RequestStream``; ``generate(...)`` does that and iterates it.
* Streams yield ``RequestOutput``s in *delta* form (each holds only the text/tokens/
  logprobs new since the previous one, for the one sequence that changed; ``index`` says
  which).  The last has ``finished``.
* Closing a stream early (client disconnect: the handler's ``finally``) aborts the request
  in the core: its blocks are freed at the next step.
* ``abort(request_id)`` (cancel by id, drain timeout) ends a running stream with a
  final output whose sequences carry ``finish_reason="abort"``.
* Admission: at most ``max_pending_seqs`` sequences in flight (running + queued); a request
  that would exceed it is refused whole (``EngineOverloadedError``; an n=3 request is
  admitted all-or-nothing) before anything is sent to the core.
* When the core dies or fails a step, every in-flight stream raises
  ``EngineDeadError``, later calls raise it at once, and ``on_dead`` callbacks run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from pagedllm.engine.mp_client import AsyncMPClient, EngineDeadError
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestStream"]


class EngineOverloadedError(RuntimeError):
    """Admission control refused the request (the server answers 503 + Retry-After)."""


class _OutputStream:
    """The per-request sink the ``OutputProcessor`` pushes into (``put`` never blocks:
    the output loop must not wait on a slow client)."""

    def __init__(self) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; deltas queued behind it are merged into it
        (``RequestOutput.add``), so a consumer that fell behind -- a busy event loop, a
        slow client -- catches up with one chunk instead of one per engine step.  An
        error is raised once the outputs before it have been returned."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        while self._items and isinstance(nxt := self._items[0], RequestOutput):
            self._items.popleft()
            item.add(nxt)
        return item


class RequestStream:
    """The outputs of one request, as an async iterator (see ``AsyncLLM.add_request``).

    ``close()`` is synchronous and idempotent: call it in a ``finally``; if the request is
    still running it is aborted in the core."""

    def __init__(self, llm: AsyncLLM, request_id: str, n: int, sink: _OutputStream) -> None:
        self.llm = llm
        self.request_id = request_id
        self.n = n
        self.sink = sink
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.sink.get()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self.finished = True
            self.close()
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.llm._abort_in_core(self.request_id)
        self.llm._release(self)


class AsyncLLM:
    """See the module doc.  Build with ``await AsyncLLM.create(...)``."""

    def __init__(self, config: EngineConfig, client: AsyncMPClient | DPClient,
                 tokenizer: Any | None,
                 metrics: EngineMetrics | None = None, max_pending_seqs: int | None = None,
                 max_logprobs: int = 20) -> None:
        assert client.ready is not None, "start the client first"
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.metrics: EngineMetrics | None = None
        if metrics is not None:
            self.attach_metrics(metrics)
        self.ready = client.ready
        self.max_pending_seqs = max_pending_seqs
        self.input_processor = InputProcessor(
            config.model_config, tokenizer,
            client.ready.max_tokens_per_request or None, max_logprobs, config.lora_config)
        self.output_processor = OutputProcessor(tokenizer)
        self.num_pending_seqs = 0
        self._streams: dict[str, RequestStream] = {}
        self._bg_tasks: set[asyncio.Task[Any]] = set()
        self.dead: EngineDeadError | None = None
        self.on_dead: list[Callable[[EngineDeadError], None]] = []
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    @classmethod
    async def create(cls, engine_args: EngineArgs | EngineConfig, *,
                     metrics: EngineMetrics | None = None,
                     max_pending_seqs: int | None = None, max_logprobs: int = 20,
                     transport: str = "ipc") -> AsyncLLM:
        """Start the engine-core process and wait until it is ready.

        Given ``EngineArgs``, the core is spawned *first* and builds its own config from
        them, while this process builds its copy (the same arguments give the same
        config): importing torch and transformers and reading the model's config then
        happen in both processes at once instead of one after the other (~6 s saved on
        start-up).  ``metrics`` may also be attached later (:meth:`attach_metrics`).

        Raises ``ValueError`` for bad arguments and ``EngineStartupError`` (one-line reason)
        if the core cannot start."""
        loop = asyncio.get_running_loop()
        dp = engine_args.parallel_config.data_parallel_size if isinstance(
            engine_args, EngineConfig) else engine_args.data_parallel_size
        client: AsyncMPClient | DPClient = AsyncMPClient(engine_args, transport=transport) \
            if dp == 1 else DPClient(engine_args, int(dp), transport=transport)
        started = loop.create_task(client.start())
        try:
            config = engine_args if isinstance(engine_args, EngineConfig) else \
                await loop.run_in_executor(None, engine_args.create_engine_config)
            # The tokenizer loads here while the core loads the model over there.
            tokenizer = await loop.run_in_executor(None, load_tokenizer, config)
            await started
        except BaseException:
            started.cancel()
            client.shutdown()
            raise
        return cls(config, client, tokenizer, metrics, max_pending_seqs, max_logprobs)

    def attach_metrics(self, metrics: EngineMetrics) -> None:
        """Record into ``metrics`` from now on (the server builds them once it knows the
        served model name, i.e. after :meth:`create`)."""
        self.metrics = metrics
        # Each engine's transport (one, or one per data-parallel engine) counts the
        # peers and frames it refused; those refused before this call are added now.
        clients = self.client.clients if isinstance(self.client, DPClient) else [self.client]
        for c in clients:
            for reason, count in c.rejected.items():
                metrics.record_transport_rejected(reason, count)
            c.on_rejected = metrics.record_transport_rejected
        if isinstance(self.client, DPClient):  # per-engine gauges beside the totals
            metrics.track_engines(self.client.engine_stats, self.client.assigned,
                                  self.client.routed_by_prefix)

    # ------------------------------------------------------------------ health

    def is_healthy(self, heartbeat_timeout: float) -> bool:
        """True while the core lives and its loop sent something recently."""
        return (self.dead is None and self.client.is_alive()
                and self.client.heartbeat_age() < heartbeat_timeout)

    # ------------------------------------------------------------------ requests

    async def add_request(self, prompt: PromptType, params: SamplingParams | PoolingParams,
                          request_id: str, priority: int = 0,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate, admit and queue one request; returns its output stream.

        Raises ``ValueError`` (``ContextLengthError``) for bad input and
        ``EngineOverloadedError`` when admission refuses it -- in both cases before
        anything reaches the core -- and ``EngineDeadError``."""
        if self.dead is not None:
            raise self.dead
        arrival = time.time() if arrival_time is None else arrival_time
        # A pooling request (PoolingParams) runs whole in one step and returns a vector.
        if isinstance(params, PoolingParams):
            text, ids, params, core_reqs = self.input_processor.process_pooling(
                request_id, prompt, params, arrival, priority)
        else:
            text, ids, params, core_reqs = self.input_processor.process(
                request_id, prompt, params, arrival, priority, lora_request)
        n = sum(1 + len(r.fork_ids) for r in core_reqs)
        if (self.max_pending_seqs is not None
                and self.num_pending_seqs + n > self.max_pending_seqs):
            raise EngineOverloadedError(
                f"the server is at capacity ({self.num_pending_seqs} sequences in flight, "
                f"limit {self.max_pending_seqs}); retry later")
        sink = _OutputStream()
        self.output_processor.add_request(request_id, text, ids, params, arrival,
                                          RequestOutputKind.DELTA, sink)
        stream = RequestStream(self, request_id, n, sink)
        self._streams[request_id] = stream
        self.num_pending_seqs += n
        if self.metrics is not None:
            for r in core_reqs:
                self.metrics.add_request(r)
        try:
            await self.client.add_requests(core_reqs)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """``add_request`` then iterate its stream; leaving early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self.num_pending_seqs -= stream.n

    def _abort_in_core(self, request_id: str) -> list[str]:
        """Forget ``request_id`` here and tell the core to free it (sent asynchronously,
        so this is safe to call from ``finally`` blocks of cancelled tasks)."""
        ids = self.output_processor.abort_request(request_id)
        if ids:
            if self.metrics is not None:
                self.metrics.on_finished(ids, "abort")
            if self.dead is None:
                task = asyncio.get_running_loop().create_task(
                    self.client.abort_requests(ids))
                self._bg_tasks.add(task)
                task.add_done_callback(self._bg_tasks.discard)
        return ids

    def abort(self, request_id: str) -> bool:
        """Abort a request by id; its stream ends with ``finish_reason="abort"``.
        Returns False if no such request is in flight."""
        stream = self._streams.get(request_id)
        if stream is None:
            return bool(self._abort_in_core(request_id))
        self._abort_in_core(request_id)
        stream.sink.put(RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
            outputs=[CompletionOutput(i, "", [], None, None, "abort")
                     for i in range(stream.n)],
            finished=True))
        return True

    def fail(self, request_id: str, error: BaseException) -> bool:
        """End a request's stream with ``error`` (raised to its consumer, after the
        outputs already queued); the request is then aborted in the core.  Returns False
        if no such request is in flight."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.sink.put(error)
        return True

    def request_ids(self) -> list[str]:
        return list(self._streams)

    # ------------------------------------------------------------------ output loop

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                if self.metrics is not None:
                    self.metrics.on_outputs(outputs)
                if not outputs.outputs:
                    continue  # heartbeat / stats only
                processed = self.output_processor.process_outputs(outputs)
                if processed.reqs_to_abort:
                    # Stop strings found here: the core must stop generating them.
                    if self.metrics is not None:
                        self.metrics.on_finished(processed.reqs_to_abort, "stop")
                    await self.client.abort_requests(processed.reqs_to_abort)
        except EngineDeadError as e:
            self._die(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in output processing must not hang every client
            logger.exception("output processing failed")
            self._die(EngineDeadError(f"output processing failed: {type(e).__name__}"))

    def _die(self, error: EngineDeadError) -> None:
        self.dead = error
        if self.metrics is not None:
            self.metrics.set_engine_alive(False)
        self.output_processor.fail_all(error)
        for cb in self.on_dead:
            try:
                cb(error)
            except Exception:
                logger.exception("on_dead callback failed")

    async def shutdown(self) -> None:
        self._output_task.cancel()
        try:
            await self._output_task
        except (asyncio.CancelledError, Exception):
            pass
        self.client.shutdown()
