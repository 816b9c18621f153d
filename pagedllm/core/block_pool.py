"""The block pool: every KV block, its reference count, and an O(1) LRU free list.

```
 blocks:     [0:null] [1] [2] [3] [4] [5] ...        (allocated once, never resized)
 free list:  head <-> 3 <-> 5 <-> 1 <-> ... <-> tail   (doubly linked through the blocks)
             ^ evict/allocate from the head           ^ freed blocks appended at the tail
```

* A block is on the free list iff its ``ref_cnt`` is 0.
* Block 0 is the *null block*: never handed out, it pads block tables so that unused
  table entries point somewhere harmless.
* Allocation pops from the head (least recently freed first), freeing appends to the tail,
  and ``touch`` removes an arbitrary free block from the middle -- all O(1), which the
  prefix cache needs to revive a freed-but-still-cached block.
* ``block_hash`` is kept on a freed block until the block is reused, so freed blocks keep
  serving prefix-cache hits until memory pressure evicts them (LRU order).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable


class KVCacheBlock:
    """One fixed-size KV block.  ``prev_free``/``next_free`` link the free list."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The cache key: a chained block hash (paired with its group id in a hybrid
        # manager's groups other than the first).
        self.block_hash: Hashable | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinel head and tail."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not on the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already on the free list")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):  # debugging/tests only: O(n)
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns all blocks.  Callers hold block *objects*; only this class changes ref counts."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently taken
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # Prefix cache: hash of a full block's contents (chained) -> the block holding it.
        self.cached_blocks: dict[Hashable, KVCacheBlock] = {}
        # The most blocks ever referenced at once since ``reset_peak`` (benchmarks).
        self.peak_blocks_in_use = 0
        # Called with a cached block about to be handed out (its hash not yet dropped):
        # the prefix cache's host tier saves it there (core/offload_tier.py).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_usable_blocks - self.free_queue.num_free

    def reset_peak(self) -> None:
        self.peak_blocks_in_use = self.num_blocks_in_use

    def _note_peak(self) -> None:
        used = self.num_usable_blocks - self.free_queue.num_free
        if used > self.peak_blocks_in_use:
            self.peak_blocks_in_use = used

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    # -- allocation ----------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the LRU head (evicting their cached hash), ref_cnt 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        on_evict = self.on_evict
        for _ in range(n):
            b = self.free_queue.popleft()
            if on_evict is not None and b.block_hash is not None:
                on_evict(b)
            self.evict_hash(b)
            b.ref_cnt = 1
            out.append(b)
        self._note_peak()
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (reviving free cached blocks)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        self._note_peak()

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 go to the free-list tail.

        Callers pass a request's blocks in *reverse* order so that a request's tail
        blocks (least likely shared) are evicted before its prefix.
        """
        for b in blocks:
            if b.ref_cnt <= 0 or b is self.null_block:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        """Record that ``block`` (full, computed) holds the tokens hashed to ``block_hash``."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return  # already cached (or another block holds the same content)
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def evict_hash(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s cached contents (no prefix hit will return it)."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for b in self.blocks[1:]:
            b.block_hash = None
        self.cached_blocks.clear()
        return True
