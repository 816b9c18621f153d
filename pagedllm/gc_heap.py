"""Keep the start-up heap out of Python's garbage collector.

A long-lived server process ends start-up holding hundreds of thousands of container
objects that live forever (torch and transformers modules, FastAPI's routes and models,
the model's parameters).  Every full (generation-2) collection traverses all of them:
in the API server that measured 90-350 ms on the 2-core CPU machine, during which no
token is streamed and no request reaches the engine core -- the longest first-token and
inter-token tails of W2.  ``gc.freeze()`` moves everything alive now into the permanent
generation, which collections skip; objects created while serving are collected as
before.  (vLLM does the same after its start-up.)

The offline ``LLM`` runs the engine core in the user's process, so it freezes too: on an
H200 one full collection of the unfrozen start-up heap stalled a W1 run for 218 ms (3%),
once every two or three runs.  A process may build engine after engine (tests,
notebooks), so each freeze first undoes the last: the collection that follows then
frees the earlier engines' reference cycles, which a frozen heap would keep forever.
An engine's shutdown (``LLM.shutdown``, or dropping the last reference to the ``LLM``)
undoes it too (``release_gc_heap``): frozen, the model's reference cycles -- and with them
its weights -- would outlive it.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("pagedllm")


def freeze_gc_heap(what: str) -> None:
    """Unfreeze, collect once, then freeze every surviving object (call at the end of
    start-up)."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    logger.debug("%s: froze %d objects out of the garbage collector in %.0f ms", what,
                 gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3)


def release_gc_heap() -> int:
    """Unfreeze the heap and collect it (an engine has shut down); returns the number of
    unreachable objects found.  Another live engine's heap is merely unfrozen until the
    next engine's start-up freezes again."""
    gc.unfreeze()
    return gc.collect()
