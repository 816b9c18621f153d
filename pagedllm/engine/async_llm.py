"""AsyncLLM: the asyncio engine behind the API server.

::

    generate() ── InputProcessor.process ──► AsyncMPClient.add_requests ──► core process
        ▲                                                                      │
        │ per-request _OutputStream (DELTA RequestOutputs, or an exception)    │
        └── OutputProcessor.process_outputs ◄── output loop task ◄─────────────┘

Contract:

* ``generate(prompt, params, request_id)`` is an async iterator of ``RequestOutput`` in
  *delta* form (each output holds only the text/tokens/logprobs new since the previous one,
  for the one sequence that changed; ``index`` says which).  The last has ``finished``.
* Leaving the iterator early (client disconnect: the task is cancelled, or ``aclose``)
  aborts the request in the core: its blocks are freed at the next step.
* ``abort(request_id)`` (cancel by id, drain timeout) ends a running ``generate`` with a
  final output whose sequences carry ``finish_reason="abort"``.
* Admission: at most ``max_pending_seqs`` sequences in flight (running + queued); a request
  that would exceed it is refused whole (``EngineOverloadedError``; an n=3 request is
  admitted all-or-nothing) before anything is sent to the core.
* When the core dies or fails a step, every in-flight ``generate`` raises
  ``EngineDeadError``, later calls raise it at once, and ``on_dead`` callbacks run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.mp_client import AsyncMPClient, EngineDeadError
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]


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
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    """See the module doc.  Build with ``await AsyncLLM.create(...)``."""

    def __init__(self, config: EngineConfig, client: AsyncMPClient, tokenizer: Any | None,
                 metrics: EngineMetrics | None = None, max_pending_seqs: int | None = None,
                 max_logprobs: int = 20) -> None:
        assert client.ready is not None, "start the client first"
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ready = client.ready
        self.max_pending_seqs = max_pending_seqs
        self.input_processor = InputProcessor(
            config.model_config, tokenizer,
            client.ready.max_tokens_per_request or None, max_logprobs)
        self.output_processor = OutputProcessor(tokenizer)
        self.num_pending_seqs = 0
        self._streams: dict[str, tuple[_OutputStream, int]] = {}
        self.dead: EngineDeadError | None = None
        self.on_dead: list[Callable[[EngineDeadError], None]] = []
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    @classmethod
    async def create(cls, engine_args: EngineArgs | EngineConfig, *,
                     metrics: EngineMetrics | None = None,
                     max_pending_seqs: int | None = None, max_logprobs: int = 20,
                     transport: str = "ipc") -> AsyncLLM:
        """Start the engine-core process and wait until it is ready.

        Raises ``ValueError`` for bad arguments and ``EngineStartupError`` (one-line reason)
        if the core cannot start."""
        config = (engine_args.create_engine_config()
                  if isinstance(engine_args, EngineArgs) else engine_args)
        client = AsyncMPClient(config, transport=transport)
        loop = asyncio.get_running_loop()
        started = loop.create_task(client.start())
        try:
            # The tokenizer loads here while the core loads the model over there.
            tokenizer = await loop.run_in_executor(None, load_tokenizer, config)
            await started
        except BaseException:
            started.cancel()
            client.shutdown()
            raise
        return cls(config, client, tokenizer, metrics, max_pending_seqs, max_logprobs)

    # ------------------------------------------------------------------ health

    def is_healthy(self, heartbeat_timeout: float) -> bool:
        """True while the core lives and its loop sent something recently."""
        return (self.dead is None and self.client.is_alive()
                and self.client.heartbeat_age() < heartbeat_timeout)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream delta ``RequestOutput``s (see module doc).  Raises ``ValueError``
        (``ContextLengthError``) for bad input before anything is queued,
        ``EngineOverloadedError`` when admission refuses it, ``EngineDeadError``."""
        if self.dead is not None:
            raise self.dead
        arrival = time.time() if arrival_time is None else arrival_time
        text, ids, params, core_reqs = self.input_processor.process(
            request_id, prompt, params, arrival, priority)
        n = len(core_reqs)
        if (self.max_pending_seqs is not None
                and self.num_pending_seqs + n > self.max_pending_seqs):
            raise EngineOverloadedError(
                f"the server is at capacity ({self.num_pending_seqs} sequences in flight, "
                f"limit {self.max_pending_seqs}); retry later")
        stream = _OutputStream()
        self.output_processor.add_request(request_id, text, ids, params, arrival,
                                          RequestOutputKind.DELTA, stream)
        self._streams[request_id] = (stream, n)
        self.num_pending_seqs += n
        finished = False
        try:
            if self.metrics is not None:
                for r in core_reqs:
                    self.metrics.add_request(r.request_id, arrival, len(ids))
            await self.client.add_requests(core_reqs)
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self.num_pending_seqs -= n
            self._streams.pop(request_id, None)
            if not finished and self.dead is None:
                # Cancelled (client gone) or closed early: free its blocks in the core.
                # Shielded: this runs while the task is being cancelled.
                await asyncio.shield(self._abort_ids(request_id))

    async def _abort_ids(self, request_id: str) -> list[str]:
        ids = self.output_processor.abort_request(request_id)
        if ids:
            if self.metrics is not None:
                self.metrics.on_finished(ids, "abort")
            try:
                await self.client.abort_requests(ids)
            except Exception:  # the core is dying: nothing left to free
                logger.debug("abort of %s not delivered", request_id)
        return ids

    async def abort(self, request_id: str) -> bool:
        """Abort a request by id; its ``generate`` ends with ``finish_reason="abort"``.
        Returns False if no such request is in flight."""
        entry = self._streams.get(request_id)
        ids = await self._abort_ids(request_id)
        if entry is None:
            return bool(ids)
        stream, n = entry
        stream.put(RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
            outputs=[CompletionOutput(i, "", [], None, None, "abort") for i in range(n)],
            finished=True))
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
