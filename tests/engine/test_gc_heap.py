"""freeze_gc_heap: the start-up heap leaves full collections, and a second freeze (a
second engine in the same process) lets the first one's reference cycles be freed."""

from __future__ import annotations

import gc
import weakref

from pagedllm.gc_heap import freeze_gc_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_then_refreeze_frees_earlier_cycles() -> None:
    try:
        node = _Node()
        ref = weakref.ref(node)
        freeze_gc_heap("test")
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: a collection does not look at it
        freeze_gc_heap("test again")  # unfreezes first, so the collection frees it
        assert ref() is None
    finally:
        gc.unfreeze()
