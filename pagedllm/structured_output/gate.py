"""The engine core's waiting room for requests whose grammar is still compiling.

``EngineCore.add_request`` hands a structured-output request here instead of to the
scheduler; compilation runs on the compiler's worker thread while the engine keeps
stepping the other requests.  Each step, :meth:`GrammarGate.ready` releases the requests
whose grammar is done (the runner then finds it in the compiler's cache) and reports the
ones whose compilation failed, which the core finishes with ``abort`` (the frontend
validates every constraint first, so that is a backstop, never a dead engine).
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from typing import Any

from pagedllm.request import Request
from pagedllm.structured_output.backend import GrammarCompiler, clean_error

logger = logging.getLogger("pagedllm")


class GrammarGate:
    def __init__(self, load_tokenizer: Any, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(load_tokenizer, vocab_size)
        self._waiting: dict[str, tuple[Request, Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Request) -> None:
        so = req.sampling_params.structured_outputs
        assert so is not None
        self._waiting[req.request_id] = (req, self.compiler.submit(so))

    def abort(self, request_ids: list[str]) -> None:
        """Forget aborted requests and cancel their queued compiles (a sequence id of an
        n > 1 group drops that sequence)."""
        for rid in request_ids:
            gone = self._waiting.pop(rid, None)
            if gone is not None:
                # A compile not started yet never runs (one already running finishes:
                # the API's time budget bounds it, and its grammar is cached).
                gone[1].cancel()
                continue
            for req, _ in self._waiting.values():
                if rid in req.fork_ids:
                    req.fork_ids.remove(rid)
                    req.reserved_slots = len(req.fork_ids)

    def ready(self) -> tuple[list[Request], list[Request]]:
        """(requests whose grammar compiled, requests whose compilation failed)."""
        done, failed = [], []
        for rid, (req, fut) in list(self._waiting.items()):
            if not fut.done():
                continue
            del self._waiting[rid]
            err = CancelledError() if fut.cancelled() else fut.exception()
            if err is None:
                done.append(req)
            else:
                logger.warning("request %s: grammar compilation failed: %s", rid,
                               clean_error(err))
                failed.append(req)
        return done, failed

    def wait(self, timeout: float) -> None:
        """Block until some compilation finishes (or ``timeout`` seconds)."""
        if self._waiting:
            wait([f for _, f in self._waiting.values()], timeout=timeout,
                 return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.compiler.shutdown()
