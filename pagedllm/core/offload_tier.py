"""The host tier of the prefix cache (``kv_offload_bytes``): KV blocks evicted from the
device pool are kept in host memory, keyed by their block hash, and loaded back on a
prefix hit (torch-free bookkeeping; the runner's ``BlockOps`` copies the bytes).

```
 device pool (BlockPool)                         host pool (this class)
 free list head ─► [b] hash h ── evicted ──copy──► slot s   lru: {h: s, ...}  (LRU first)
                                 (offload pairs: (b, s))
 lookup of request r:  hashes [h0][h1][h2][h3]
                       device  hit  miss miss     host: h1 -> s1, h2 -> s2, h3 missing
    promote: new blocks b1, b2 ◄──copy── s1, s2   (load pairs: (s1, b1), (s2, b2))
             registered as h1, h2 and put back on the free list: ordinary device hits
             for ``get_computed_blocks``, which follows at once
```

Contracts (the runner's order, ``worker/block_ops.py``: swap-outs, offloads, swap-ins,
loads, copy-on-write copies -- all before the step's forward writes any KV):

* **A block is saved before its new owner writes it.**  ``BlockPool`` calls ``_save``
  when it hands out a free block that still holds a cached hash; that block was computed
  by an earlier step (a block registered in this step and released before it ran had its
  hash dropped, ``KVCacheManager._release``), so the copy, ordered before this step's
  writes, reads valid KV.  A hash the host already holds is only marked recently used.
* **A block loaded this step is valid when the forward reads it.**  Loads follow the
  offloads (so a block saved and looked up in one step round-trips), and a host slot
  read by a load this step is never given to another hash before the step's copies are
  taken (``take_copies``), so no offload overwrites it first.
* **Destinations are distinct.**  A promoted block evicted again in the same step (it
  was not admitted and another allocation took it) has its load cancelled: its new
  owner writes it, and the host keeps the copy.
* **Inclusive.**  A loaded hash stays in the host pool (LRU-touched): evicting the
  device copy again costs no copy.
* **Nothing leaks.**  Promoted blocks go back to the device free list at once (the
  request's ``allocate_slots`` references them like any hit, or they stay cached);
  host slots are either free or hold exactly one hash.

The copies are synchronous with the step (ordered before its forward on the compute
stream); a fully overlapped load on a copy stream, a step ahead, is not done yet.
Hybrid KV cache groups work unchanged: a pool key carries its group, and a block id is
one page in every shared KV tensor, which the runner copies whole.  A sliding-window
group promotes every host-held block of the walk, also those before the window of the
hit that follows (correct, but bytes it need not move).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


class _KeyedManager(Protocol):
    """What the tier needs of a ``KVCacheManager`` (one per KV cache group)."""

    block_size: int

    def block_keys(self, request: Request, num_blocks: int) -> list[Hashable]: ...

    def wants_prefix_lookup(self, request: Request) -> bool: ...


@dataclass(slots=True)
class OffloadStats:
    """The tier's counters since the last ``take_stats``: tokens looked up past the
    device hit and tokens found on the host (vLLM's external prefix cache), blocks
    copied each way, and the host pool's fill."""

    queries: int = 0
    hits: int = 0
    blocks_to_host: int = 0
    blocks_to_device: int = 0
    usage: float = 0.0


class OffloadTier:
    """The host pool's index (hash -> slot, LRU) and the step's copy lists.

    ``managers``: the KV cache manager of each group (one without hybrid groups), all on
    ``pool``.  ``num_host_blocks``: slots in the runner's host KV tensors.
    """

    def __init__(self, pool: BlockPool, managers: Sequence[_KeyedManager],
                 num_host_blocks: int) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"kv_offload_bytes: the host pool holds {num_host_blocks} "
                             "blocks; it needs at least one")
        self.pool = pool
        self.managers = list(managers)
        self.block_size = self.managers[0].block_size
        self.num_host_blocks = num_host_blocks
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # least recent first
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        # This step's copies: (device block, host slot) and (host slot, device block).
        self._offload: list[tuple[int, int]] = []
        self._load: dict[int, int] = {}  # device block -> host slot (insertion order)
        self._reading: set[int] = set()  # host slots loads read this step: pinned
        self._stats = OffloadStats()
        # The last lookup's (request id, queried tokens, hit tokens): counted only when
        # that request is admitted (``record_lookup``), as the device cache's are.
        self._last: tuple[str, int, int] | None = None
        self.total_hit_blocks = 0
        pool.on_evict = self._save

    # -- queries -------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def slot_of(self, key: Hashable) -> int | None:
        """The host slot holding ``key`` (tests and debugging)."""
        return self._lru.get(key)

    # -- device eviction -> host ---------------------------------------------------
    def _save(self, block: KVCacheBlock) -> None:
        """``BlockPool`` hands out ``block``, which still holds a cached hash: keep its
        KV on the host (see the module doc's contracts)."""
        key = block.block_hash
        if key is None:
            return
        if self._load.pop(block.block_id, None) is not None:
            return  # promoted this step and evicted again: the host still holds it
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is being read this step: this block is lost
        self._lru[key] = slot
        self._offload.append((block.block_id, slot))

    def _take_slot(self) -> int | None:
        """A free host slot, else the least recently used one not read this step."""
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():
            if slot not in self._reading:
                del self._lru[key]
                return slot
        return None

    # -- host -> device ------------------------------------------------------------
    def promote(self, request: Request, max_blocks: int | None = None) -> int:
        """Bring the host-held blocks of ``request``'s cached prefix back to the device
        before its prefix lookup, in every group; returns the blocks promoted.

        Walks the request's full blocks (at most ``max_blocks``, default: all but the
        last token's, like ``get_computed_blocks``) and stops at the first block cached
        in neither tier.  Device hits along the way are referenced while new blocks are
        taken, so the new blocks cannot evict them; each new block is registered under
        its hash, its load is queued, and all go back to the free list (tail first, so
        the prefix stays cached longest).  When the device pool has fewer free blocks
        than host hits, the first ones are promoted.
        """
        first = self.managers[0]
        if not first.wants_prefix_lookup(request):
            self._last = None
            return 0
        bs = self.block_size
        n = (request.num_tokens - 1) // bs if max_blocks is None else max_blocks
        pool = self.pool
        queried = hit = promoted = 0
        for m in self.managers:
            chain: list[KVCacheBlock | tuple[Hashable, int]] = []
            device_prefix = -1
            for i, key in enumerate(m.block_keys(request, n)):
                b = pool.get_cached_block(key)
                if b is not None:
                    chain.append(b)
                    continue
                if device_prefix < 0:
                    device_prefix = i
                slot = self._lru.get(key)
                if slot is None:
                    break
                chain.append((key, slot))
            if device_prefix < 0:
                device_prefix = len(chain)
            if m is first:
                queried = (n - device_prefix) * bs
            todo = [c for c in chain if not isinstance(c, KVCacheBlock)]
            if not todo:
                continue
            held = [c for c in chain if isinstance(c, KVCacheBlock)]
            pool.touch(held)
            todo = todo[:pool.num_free_blocks]
            for _, slot in todo:
                self._reading.add(slot)  # (before get_new_blocks: it may evict to host)
            new = pool.get_new_blocks(len(todo))
            for b, (key, slot) in zip(new, todo):
                pool.cache_block(b, key)
                self._load[b.block_id] = slot
                self._lru.move_to_end(key)
            # Back in chain order, reversed: the prefix stays cached longest.
            taken = iter(new)
            order = [c if isinstance(c, KVCacheBlock) else next(taken, None)
                     for c in chain]
            pool.free_blocks(reversed([b for b in order if b is not None]))
            promoted += len(new)
            if m is first:
                hit = len(new) * bs
        self._last = (request.request_id, queried, hit)
        self.total_hit_blocks += promoted
        return promoted

    def record_lookup(self, request: Request) -> None:
        """Count the last ``promote`` when its request is admitted (a request that
        waits is looked up again and must not count twice)."""
        if self._last is not None and self._last[0] == request.request_id:
            self._stats.queries += self._last[1]
            self._stats.hits += self._last[2]
        self._last = None

    # -- the step's copies -----------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies queued since the last call, for the step about to run:
        ``(offloads (device, host), loads (host, device))``; unpins the host slots."""
        offload, self._offload = self._offload, []
        load = [(s, d) for d, s in self._load.items()]
        self._load = {}
        self._reading.clear()
        self._stats.blocks_to_host += len(offload)
        self._stats.blocks_to_device += len(load)
        return offload, load

    def take_stats(self) -> OffloadStats:
        """The counters since the last call (usage is the current fill, 0..1)."""
        s, self._stats = self._stats, OffloadStats()
        s.usage = len(self._lru) / self.num_host_blocks
        return s

    def reset(self) -> None:
        """Forget every host-held hash (``reset_prefix_cache``; nothing is in flight:
        the copies queued so far have been taken)."""
        self._lru.clear()
        self._free = list(range(self.num_host_blocks - 1, -1, -1))
        self._reading.clear()

    def check_invariants(self) -> None:
        """Every slot free or holding one hash (tests)."""
        slots = sorted([*self._free, *self._lru.values()])
        assert slots == list(range(self.num_host_blocks)), "host slot leaked or doubled"


def make_offload_tier(kv: object, num_host_blocks: int) -> OffloadTier | None:
    """The host tier over ``kv`` (a ``KVCacheManager`` or a hybrid manager, whose
    ``managers`` are its groups), or None when ``num_host_blocks`` is 0 (off)."""
    if num_host_blocks <= 0:
        return None
    managers = getattr(kv, "managers", None) or [kv]
    return OffloadTier(kv.pool, managers, num_host_blocks)  # type: ignore[attr-defined]
