"""The API server's grammar checks, off the event loop, bounded in time and size.

::

    request ──check_limits (µs, in the handler)──► GrammarChecker.check ──► 400 / go on
                                                     │ one idle worker process
                                                     ▼
                                   check_worker: parse, empty-language check,
                                   compile against the model's vocabulary

Why processes: xgrammar is C++ and holds a thread for as long as a compile takes (a
900-deep schema: over a minute; a 5,000-rule EBNF: ~90 s before the up-front bounds),
and nothing can stop a thread.  A worker process can be killed: when a check runs past
``timeout`` seconds, or its request is gone (the awaiting task is cancelled, or
``gone()`` says the client left), the worker is killed at once and replaced on next
use, so an abandoned compile never keeps a worker (or a CPU) busy.  ``max_bytes``
bounds the compiled grammar's size (xgrammar's ``memory_size_bytes``: a 50,000-value
enum is ~160 MB).  Both limits are 400s naming the limit.

``num_workers`` checks run at once; more wait for an idle worker, and time spent
waiting does not count against a request's budget.  A constraint that passed is
remembered (by ``StructuredOutputsParams.key()``, bounded by ``PASSED_CHARS``), so a
repeated schema costs no second check.  The engine core compiles the same
grammar again when the request arrives (``backend.GrammarCompiler``); this check is
what bounds that compile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from pagedllm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger("pagedllm")

CHECK_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES = 64 * 2**20
_POLL_S = 0.25  # how often a running check asks whether its client is still there
PASSED_CHARS = 16 * 2**20  # the passed-constraints memo's bound (characters of keys)


class GrammarCheckError(ValueError):
    """The constraint is invalid or over a limit; the message starts with the field."""


class CheckAbandoned(Exception):
    """The request's client went away during the check (the worker was killed)."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class GrammarChecker:
    """A pool of ``num_workers`` check processes (see the module doc).

    ``tokenizer_info``: a callable returning xgrammar's ``TokenizerInfo`` JSON for the
    model (called once, on a thread, when the first worker starts), or None to check
    without compiling against a vocabulary."""

    def __init__(self, tokenizer_info: Callable[[], str | None] | None = None, *,
                 num_workers: int = 2, timeout: float = CHECK_TIMEOUT_S,
                 max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self._tokenizer_info = tokenizer_info
        self._info_json: str | None = None
        self._info_loaded = False
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None
        self._busy: set[_Worker] = set()
        self.num_killed = 0  # workers killed for a late reply or a gone client
        # Constraints that passed (StructuredOutputsParams.key() -> compiled bytes): a
        # repeated schema is not checked again.
        self._passed: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._passed_chars = 0

    async def _spawn(self) -> _Worker:
        if not self._info_loaded:
            if self._tokenizer_info is not None:
                self._info_json = await asyncio.to_thread(self._tokenizer_info)
            self._info_loaded = True
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagedllm.structured_output.check_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=1 << 20)
        worker = _Worker(proc)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"tokenizer_info": self._info_json}).encode()
                             + b"\n")
            await proc.stdin.drain()
            ready = await asyncio.wait_for(proc.stdout.readline(), 120)
        except (asyncio.TimeoutError, OSError):
            ready = b""
        if not ready.startswith(b'{"ready"'):
            await worker.kill()
            raise RuntimeError("the grammar-check worker did not start")
        return worker

    async def start(self) -> None:
        """Start one worker now instead of at the first structured-output request."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.num_workers)
        async with self._slots:
            if not self._idle:
                self._idle.append(await self._spawn())

    async def check(self, p: StructuredOutputsParams, field: str,
                    gone: Callable[[], Awaitable[bool]] | None = None) -> int:
        """The compiled grammar's size in bytes, or ``GrammarCheckError`` (invalid, over
        the time or size budget), or ``CheckAbandoned`` (``gone()`` turned true)."""
        key = p.key()
        if key in self._passed:  # checked before: the same grammar, the same answer
            self._passed.move_to_end(key)
            return self._passed[key]
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.num_workers)
        params = {k: v for k, v in dataclasses.asdict(p).items()
                  if k != "reasoning_end_token_ids"}
        line = json.dumps({"params": params, "field": field,
                           "max_bytes": self.max_bytes}).encode() + b"\n"
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._spawn()
            self._busy.add(worker)
            keep = False
            try:
                reply = await self._exchange(worker, line, field, gone)
                keep = True
            finally:
                self._busy.discard(worker)
                if keep and worker.proc.returncode is None:
                    self._idle.append(worker)
                else:
                    self.num_killed += 1
                    await worker.kill()
        if "error" in reply:
            raise GrammarCheckError(str(reply["error"]))
        size = int(reply.get("bytes", 0))
        self._remember(key, size)
        return size

    def _remember(self, key: tuple[str, str], size: int) -> None:
        """Keep ``key`` as passed (LRU, at most ``PASSED_CHARS`` characters of keys)."""
        if key in self._passed:
            return
        self._passed[key] = size
        self._passed_chars += len(key[1])
        while self._passed_chars > PASSED_CHARS and self._passed:
            old, _ = self._passed.popitem(last=False)
            self._passed_chars -= len(old[1])

    async def _exchange(self, worker: _Worker, line: bytes, field: str,
                        gone: Callable[[], Awaitable[bool]] | None) -> dict[str, object]:
        proc = worker.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line)
        await proc.stdin.drain()
        read = asyncio.ensure_future(proc.stdout.readline())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    logger.warning("%s: grammar check over its %.0f s budget; worker "
                                   "killed", field, self.timeout)
                    raise GrammarCheckError(
                        f"{field}: compiling the constraint takes longer than the limit "
                        f"of {self.timeout:g} s")
                done, _ = await asyncio.wait({read}, timeout=min(left, _POLL_S))
                if done:
                    raw = read.result()
                    if not raw:
                        raise GrammarCheckError(
                            f"{field}: the constraint could not be compiled within the "
                            "checker's bounds")
                    reply = json.loads(raw)
                    assert isinstance(reply, dict)
                    return reply
                if gone is not None and await gone():
                    logger.info("%s: the client left during its grammar check; worker "
                                "killed", field)
                    raise CheckAbandoned
        finally:
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await read

    async def close(self) -> None:
        for w in [*self._idle, *self._busy]:
            await w.kill()
        self._idle.clear()
