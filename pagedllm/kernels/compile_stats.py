"""Counts Triton kernel compilations, so start-up can log what JIT compilation cost.

On a machine whose Triton cache (``~/.triton/cache``) is empty every kernel variant the
engine uses is compiled during the memory profile and the CUDA-graph capture -- several
seconds of a first start.  ``install()`` chains a listener onto
``triton.knobs.compilation.listener``; ``snapshot()`` returns the totals so far.  The
times are Triton's own compiler stages (IR build, lowering, ptxas); the Python-side
binding and the module load are not included.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompileStats:
    compiled: int = 0  # variants compiled in this process
    cache_hits: int = 0  # variants loaded from Triton's on-disk cache
    compile_s: float = 0.0  # compiler time of the compiled ones


_lock = threading.Lock()
_stats = CompileStats()
_installed = False


def install() -> None:
    """Start counting (idempotent).  A listener already set is still called."""
    global _installed
    if _installed:
        return
    import triton

    previous = triton.knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        global _stats
        with _lock:
            s = _stats
            if cache_hit:
                _stats = CompileStats(s.compiled, s.cache_hits + 1, s.compile_s)
            else:
                _stats = CompileStats(s.compiled + 1, s.cache_hits,
                                      s.compile_s + times.total / 1e6)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group,
                     times=times, cache_hit=cache_hit)

    triton.knobs.compilation.listener = listener
    _installed = True


def snapshot() -> CompileStats:
    """Totals since ``install()``."""
    with _lock:
        return _stats
