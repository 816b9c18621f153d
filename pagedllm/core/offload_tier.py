"""The host tier of the prefix cache (``kv_offload_bytes``): KV blocks evicted from the
device pool are kept in host memory, keyed by their block hash, and loaded back on a
prefix hit, in the step that admits the request that needs them (torch-free
bookkeeping; the runner's ``BlockOps`` copies the bytes).

```
 device pool (BlockPool)                         host pool (this class)
 free list head ─► [b] hash h ── evicted ──copy──► slot s   lru: {h: s, ...}  (LRU first)
                                 (offload pairs: (b, s))
 lookup of waiting request r:  hashes [h0][h1][h2][h3]
                               device  hit  miss miss     host: h1 -> s1, h2 -> s2
 step N    promote: new blocks b1, b2 ◄──copy── s1, s2   (load pairs: (s1, b1), (s2, b2))
           registered as h1, h2, held (with b0) until the step's copies are taken;
           r's lookup finds b0, b1, b2 as device hits (num_cached_tokens counts
           them) and r is admitted in this step
           runner: loads on a copy stream, layer by layer, overlapping step N's
           forward; each layer's attention first waits for that layer's copies
```

Contracts (the runner's order, ``worker/block_ops.py``: wait for the last step's loads;
swap-outs; the disk moves; the offloads' gathers on the compute stream; swap-ins; then
on the copy stream, layer by layer, the offloads' scatters into the host pool and the
loads from it; copy-on-write copies):

* **A block is saved before its new owner writes it.**  ``BlockPool`` calls ``_save``
  when it hands out a free block that still holds a cached hash; that block was computed
  by an earlier step (a block registered in this step and released before it ran had its
  hash dropped, ``KVCacheManager._release``; a loading block is held, so it is not on
  the free list), so the copy, ordered before this step's writes, reads valid KV.  A hash
  the host already holds is only marked recently used.
* **A loading block is read only after its copy lands, and never written.** The loads
  issued with step N's output are read by step N's forward -- by the request that
  promoted them and any other whose prefix runs through them -- and the runner makes
  each layer's attention wait for that layer's copies first (worker/block_ops.py);
  everything of step N+1 runs after all of them.  A promoted block is full and
  registered under its hash, so no one writes it, and in step N it is referenced by the
  tier (``_holds``), so no allocation takes it.  The holds are dropped when the copies
  are taken: from step N+1 on the blocks are ordinary cached blocks, referenced by the
  requests admitted on them (else at the free list's tail, prefix last).  A request
  promoted but not admitted (no room, or only part of its prefix promoted: it waits a
  step for the rest) finds them as device hits later while they stay cached; an abort or
  preemption has nothing of the tier's to release (``forget`` drops its counters).
* **A host slot read by a load is not overwritten before the copy reads it.**  A slot
  read by a load queued this step is never given to another hash before the step's
  copies are taken (``_pinned``); the runner's copy stream reads it after this step's
  offloads (so a block saved and looked up in one step round-trips), and the next
  step's offloads follow on the same stream; its disk moves, copies on the host, first
  wait for that stream.  A slot written this step (an offload, a disk load) is pinned as well:
  two copies never land in one slot in one step.
* **Destinations are distinct.**  A loading block is held, so it cannot be promoted,
  evicted or taken again in the same step.
* **Inclusive.**  A loaded hash stays in the host pool (LRU-touched): evicting the
  device copy again costs no copy.
* **Nothing leaks.**  Holds last until ``take_copies``; host slots are either free or
  hold exactly one hash.

**The disk tier** (``kv_offload_disk_bytes``, core/disk_tier.py) sits behind this one:
a host slot reused for another key first saves its key to disk (``DiskTier.save``), and
a promotion walks on through keys held only on disk, giving each a host slot with a
disk -> host load queued before the host -> device load.  The runner applies the disk
moves (on the host) before this tier's.

Hybrid KV cache groups work unchanged: a pool key carries its group, and a block id is
one page in every shared KV tensor, which the runner copies whole.  The full-attention
groups are walked first; a sliding-window group then walks only the blocks inside the
window of the furthest hit they allow (a hit needs no more), so a long history moves
about ``window / block_size`` blocks per sliding group, not all of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.disk_tier import DiskTier
from pagedllm.messages import SchedulerStats
from pagedllm.request import Request


class _KeyedManager(Protocol):
    """What the tier needs of a ``KVCacheManager`` (one per KV cache group)."""

    block_size: int
    sliding_window: int | None  # None: full attention

    def block_keys(self, request: Request, num_blocks: int) -> list[Hashable]: ...

    def wants_prefix_lookup(self, request: Request) -> bool: ...


@dataclass(slots=True)
class OffloadStats:
    """The tier's counters since the last ``take_stats``: tokens looked up past the
    device hit and tokens found off the device -- on the host or on disk (vLLM's
    external prefix cache), blocks copied each way, and the host pool's fill; with the
    disk tier also tokens looked up past the device and host hits and tokens found on
    disk, blocks copied host -> disk and disk -> host, and the disk pool's fill."""

    queries: int = 0
    hits: int = 0
    blocks_to_host: int = 0
    blocks_to_device: int = 0
    usage: float = 0.0
    disk_queries: int = 0
    disk_hits: int = 0
    blocks_to_disk: int = 0
    blocks_from_disk: int = 0
    disk_usage: float = 0.0


class OffloadTier:
    """The host pool's index (hash -> slot, LRU) and the step's copy lists.

    ``managers``: the KV cache manager of each group (one without hybrid groups), all on
    ``pool``.  ``num_host_blocks``: slots in the runner's host KV tensors.  ``disk``:
    the disk tier behind the host pool, or None.
    """

    def __init__(self, pool: BlockPool, managers: Sequence[_KeyedManager],
                 num_host_blocks: int, disk: DiskTier | None = None) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"kv_offload_bytes: the host pool holds {num_host_blocks} "
                             "blocks; it needs at least one")
        self.pool = pool
        self.managers = list(managers)
        # The promotion walk's order: full-attention groups first, since a sliding
        # group's window is placed at the end of their hit.
        self._walk = sorted(self.managers, key=lambda m: m.sliding_window is not None)
        self.block_size = self.managers[0].block_size
        self.num_host_blocks = num_host_blocks
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # least recent first
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        # This step's copies: (device block, host slot) and (host slot, device block).
        self._offload: list[tuple[int, int]] = []
        self._load: list[tuple[int, int]] = []
        self._pinned: set[int] = set()  # host slots read or written this step
        # The blocks of each promotion with loads, referenced by the tier until the
        # step's copies are taken (the module doc's second contract).
        self._holds: list[list[KVCacheBlock]] = []
        self._loaders: set[str] = set()  # request ids whose lookups promoted this step
        # The request ids whose promotions went out with the last step's copies (tests,
        # debugging): that step's forward read the loads once they landed.
        self.loading: frozenset[str] = frozenset()
        self._stats = OffloadStats()
        # The last lookup's (request id, queried tokens, hit tokens, disk-tier queried
        # tokens, disk hit tokens): counted only when that request is admitted
        # (``record_lookup``), as the device cache's are.
        self._last: tuple[str, int, int, int, int] | None = None
        # The hits of a request promoted but not (yet) admitted -- (tokens found off
        # the device, disk-tier queries resolved, tokens found on disk): its next lookup
        # finds them on the device, but they count as this tier's when it is admitted.
        self._carried: dict[str, tuple[int, int, int]] = {}
        self.disk = disk
        # The disk moves taken with the last ``take_copies``: (host slot, disk slot)
        # saves and (disk slot, host slot) loads; the runner applies them first.
        self.disk_copies: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
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
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is read or written this step: this block is lost
        self._lru[key] = slot
        self._pinned.add(slot)
        self._offload.append((block.block_id, slot))

    def _take_slot(self) -> int | None:
        """A free host slot, else the least recently used one not pinned this step,
        whose key goes to the disk tier when there is one."""
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():
            if slot not in self._pinned:
                del self._lru[key]
                if self.disk is not None:
                    self.disk.save(key, slot)
                return slot
        return None

    def _stage(self, todo: list[tuple[Hashable, int | None]]
               ) -> tuple[list[tuple[Hashable, int]], int]:
        """Prepare a promotion's host side: pin the host slots it reads, and give each
        disk hit (slot None) a host slot with a disk load queued into it.  Stops at the
        first disk hit that finds no host slot (every one pinned): the promotion is a
        prefix of ``todo``.  Returns the (key, host slot) pairs and how many came from
        disk.  (Before ``get_new_blocks``: its evictions must not take these slots.)"""
        disk = self.disk
        if disk is not None:
            # With a disk tier every block enters and leaves through a host slot: a
            # promotion leaves a slot for each device block its new blocks may evict
            # (else they would be lost) -- the rest waits for a later step.
            room = self.num_host_blocks - len(self._pinned)
            for i, (_, slot) in enumerate(todo):
                room -= 1 + (slot is None or slot not in self._pinned)
                if room < 0:
                    todo = todo[:i]
                    break
        for _, slot in todo:
            if slot is not None:
                self._pinned.add(slot)
        if disk is None or all(slot is not None for _, slot in todo):
            return todo, 0  # type: ignore[return-value]
        # Pinned first: the host slots taken below save their keys to disk, which
        # must not reuse these keys' disk slots.
        disk.pin(key for key, slot in todo if slot is None)
        staged: list[tuple[Hashable, int]] = []
        from_disk = 0
        for key, slot in todo:
            if slot is None:
                slot = self._take_slot()
                if slot is None:
                    break
                self._pinned.add(slot)
                self._lru[key] = slot
                disk.load(key, slot)
                from_disk += 1
            staged.append((key, slot))
        return staged, from_disk

    # -- host -> device ------------------------------------------------------------
    def promote(self, request: Request, max_blocks: int | None = None) -> bool:
        """Bring the host-held blocks of ``request``'s cached prefix back to the device
        before its prefix lookup, in every group.  The lookup that follows finds them
        as device hits, and the request may run in this step: the runner's attention
        waits for each layer's copies (module doc).  Returns True when the request
        should wait a step instead: this step brought back only part of what the host
        (and disk) hold of its prefix -- the rest needs device blocks or host slots that
        this step cannot give -- and the next step's promotion continues from there.

        Walks the request's full blocks (at most ``max_blocks``, default: all but the
        last token's, like ``get_computed_blocks``) and stops at the first block cached
        in neither tier.  Device hits along the way are referenced while new blocks are
        taken, so the new blocks cannot evict them; each new block is registered under
        its hash and its load queued, and the walk's blocks stay referenced until
        ``take_copies`` (then freed tail first, so the prefix stays cached longest).
        When the device pool has fewer free blocks than host hits, the first ones are
        promoted (and the request waits).  It also waits when the host slots this step
        leaves unpinned are fewer than the blocks its admission may evict.
        """
        first = self.managers[0]
        rid = request.request_id
        carried, carried_dq, carried_dh = self._carried.pop(rid, (0, 0, 0))
        if not first.wants_prefix_lookup(request):
            self._last = None
            return False
        bs = self.block_size
        n = (request.num_tokens - 1) // bs if max_blocks is None else max_blocks
        pool, disk = self.pool, self.disk
        queried = hit = promoted = found = 0
        partial = False
        disk_queried = disk_hit = disk_moved = 0
        reach = n  # where the full-attention groups' walks end: no hit goes past it
        for m in self._walk:
            # A sliding window W: a hit that ends at ``reach`` needs only the blocks its
            # last query sees, from ``lo`` on (``find_longest_cache_hit``).
            w = m.sliding_window
            lo = 0 if w is None else max(0, reach * bs - w + 1) // bs
            # Device hits as blocks, the rest as (key, host slot; None: on disk), from lo.
            chain: list[KVCacheBlock | tuple[Hashable, int | None]] = []
            device_prefix = host_prefix = -1  # first index missing there (and before)
            for i, key in enumerate(m.block_keys(request, n if w is None else reach)[lo:]):
                b = pool.get_cached_block(key)
                if b is not None:
                    chain.append(b)
                    continue
                if device_prefix < 0:
                    device_prefix = i
                slot = self._lru.get(key)
                if slot is None:
                    if host_prefix < 0:
                        host_prefix = i
                    if disk is None or key not in disk:
                        break
                chain.append((key, slot))
            if device_prefix < 0:
                device_prefix = len(chain)
            if host_prefix < 0:
                host_prefix = len(chain)
            if w is None:
                reach = min(reach, len(chain))
            if m is first:
                queried = (n - lo - device_prefix) * bs
                disk_queried = (n - lo - host_prefix) * bs if disk is not None else 0
                found = lo + len(chain)
            at = [i for i, c in enumerate(chain) if not isinstance(c, KVCacheBlock)]
            if not at:
                continue
            held = [c for c in chain if isinstance(c, KVCacheBlock)]
            pool.touch(held)
            todo, from_disk = self._stage(
                [chain[i] for i in at[:pool.num_free_blocks]])  # type: ignore[misc]
            partial |= len(todo) < len(at)
            if not todo:  # no free block (or host slot) left: nothing moves
                pool.free_blocks(reversed(held))
                continue
            new = pool.get_new_blocks(len(todo))
            for b, (key, slot) in zip(new, todo):
                pool.cache_block(b, key)
                self._load.append((slot, b.block_id))
                self._lru.move_to_end(key)
            taken = iter(new)
            hold = [c if isinstance(c, KVCacheBlock) else next(taken, None) for c in chain]
            self._holds.append([b for b in hold if b is not None])
            promoted += len(new)
            if m is first:
                hit = len(new) * bs
                disk_hit = from_disk * bs
                # Loaded blocks past the host prefix leave the disk tier's next query.
                disk_moved = sum(1 for i in at[:len(new)] if i >= host_prefix) * bs
        self.total_hit_blocks += promoted
        if promoted:
            self._loaders.add(rid)
        if hit or disk_moved or carried or carried_dq:
            # Found off the device: kept until the request is admitted
            # (``record_lookup``), for a later lookup that finds these blocks on it.
            self._carried[rid] = (carried + hit, carried_dq + disk_moved,
                                  carried_dh + disk_hit)
        self._last = (rid, queried + carried, hit + carried, disk_queried + carried_dq,
                      disk_hit + carried_dh)
        if not promoted:
            return False
        # Admitted now, its new blocks would evict cached device blocks into host slots
        # in this same step; with fewer slots left unpinned than that, those blocks would
        # find none and be dropped: it waits a step (fresh slots) instead.
        need = (-(-request.num_tokens // bs) - found) * len(self.managers)
        return partial or self.num_host_blocks - len(self._pinned) < need

    def record_lookup(self, request: Request) -> None:
        """Count the last ``promote`` when its request is admitted (a request that is
        not admitted is looked up again and must not count twice)."""
        self._carried.pop(request.request_id, None)
        if self._last is not None and self._last[0] == request.request_id:
            st = self._stats
            _, q, h, dq, dh = self._last
            st.queries, st.hits = st.queries + q, st.hits + h
            st.disk_queries, st.disk_hits = st.disk_queries + dq, st.disk_hits + dh
        self._last = None

    def forget(self, request_id: str) -> None:
        """``request_id`` left the scheduler (finished, aborted): drop its counters.
        Nothing else to release -- holds end with the step (the module doc)."""
        self._carried.pop(request_id, None)

    # -- the step's copies -----------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies queued since the last call, for the step about to run:
        ``(offloads (device, host), loads (host, device))``; the disk tier's moves go
        to ``disk_copies``.  Ends the step for the tier: unpins the host (and disk)
        slots and frees the promoted blocks' holds (their loads land before this step's
        attention reads them)."""
        offload, self._offload = self._offload, []
        load, self._load = self._load, []
        pool = self.pool
        for hold in self._holds:
            pool.free_blocks(reversed(hold))
        self._holds = []
        self._pinned.clear()
        self.loading = frozenset(self._loaders)
        self._loaders = set()
        self._stats.blocks_to_host += len(offload)
        self._stats.blocks_to_device += len(load)
        if self.disk is not None:
            self.disk_copies = self.disk.take_copies()
            self._stats.blocks_to_disk += len(self.disk_copies[0])
            self._stats.blocks_from_disk += len(self.disk_copies[1])
        return offload, load

    def take_stats(self) -> OffloadStats:
        """The counters since the last call (usage is the current fill, 0..1)."""
        s, self._stats = self._stats, OffloadStats()
        s.usage = len(self._lru) / self.num_host_blocks
        if self.disk is not None:
            s.disk_usage = self.disk.num_used / self.disk.num_disk_blocks
        return s

    def record_stats(self, stats: SchedulerStats, block_bytes: int) -> None:
        """Put the counters since the last call (``take_stats``) into the scheduler's
        ``stats``, blocks as bytes (``block_bytes`` a block)."""
        o = self.take_stats()
        stats.kv_offload_queries, stats.kv_offload_hits = o.queries, o.hits
        stats.kv_offload_bytes_to_host = o.blocks_to_host * block_bytes
        stats.kv_offload_bytes_to_device = o.blocks_to_device * block_bytes
        stats.kv_offload_usage = o.usage
        stats.kv_offload_total_blocks = self.num_host_blocks
        if self.disk is not None:
            stats.kv_offload_disk_queries = o.disk_queries
            stats.kv_offload_disk_hits = o.disk_hits
            stats.kv_offload_bytes_to_disk = o.blocks_to_disk * block_bytes
            stats.kv_offload_bytes_from_disk = o.blocks_from_disk * block_bytes
            stats.kv_offload_disk_usage = o.disk_usage
            stats.kv_offload_disk_total_blocks = self.disk.num_disk_blocks

    def reset(self) -> None:
        """Forget every host-held hash (``reset_prefix_cache``, between steps: the
        copies queued so far have been taken, so nothing is held)."""
        self._lru.clear()
        self._free = list(range(self.num_host_blocks - 1, -1, -1))
        self._pinned.clear()
        self._carried.clear()
        if self.disk is not None:
            self.disk.reset()

    def check_invariants(self) -> None:
        """Every slot free or holding one hash; every load's destination distinct and
        held (tests)."""
        slots = sorted([*self._free, *self._lru.values()])
        assert slots == list(range(self.num_host_blocks)), "host slot leaked or doubled"
        dst = [d for _, d in self._load]
        assert len(set(dst)) == len(dst), "two loads into one block"
        assert all(self.pool.blocks[d].ref_cnt > 0 for d in dst), "loading block not held"
        if self.disk is not None:
            self.disk.check_invariants()


def make_offload_tier(kv: object, num_host_blocks: int,
                      num_disk_blocks: int = 0) -> OffloadTier | None:
    """The host tier over ``kv`` (a ``KVCacheManager`` or a hybrid manager, whose
    ``managers`` are its groups), or None when ``num_host_blocks`` is 0 (off); with a
    disk tier behind it when ``num_disk_blocks`` > 0."""
    if num_host_blocks <= 0:
        return None
    managers = getattr(kv, "managers", None) or [kv]
    disk = DiskTier(num_disk_blocks) if num_disk_blocks > 0 else None
    return OffloadTier(kv.pool, managers, num_host_blocks,  # type: ignore[attr-defined]
                       disk)
