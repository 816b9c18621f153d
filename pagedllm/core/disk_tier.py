"""The prefix cache's third tier, on local disk (``kv_offload_disk_bytes``): blocks the
host tier evicts are kept in a memory-mapped file, keyed by the same pool key, and come
back through a host slot on a prefix hit (torch-free bookkeeping; the runner's
``DiskPool``, worker/disk_pool.py, moves the bytes).

```
 device pool ──evict──► host pool (OffloadTier) ──evict──► disk pool (this class)
 [b] key k              slot s  {k: s} LRU        save     slot d  {k: d} LRU
                                                  (s, d)
 lookup of r: k on neither device nor host, on disk at d:
 step N    OffloadTier.promote takes a host slot s' (LRU; its key saved here first),
           queues a disk load (d, s') and the host load (s', b) of a fresh device block
           b: the runner applies saves, then disk loads, then the host tier's moves,
           so r waits one step exactly as for a host hit
 step N+1  r's lookup: ordinary device hits
```

Contracts (the host tier's, core/offload_tier.py, hold unchanged; these add to them):

* **A save reads its host slot before anything of the step writes it.**  The host tier
  calls ``save`` when it reuses slot ``s`` for another key; the runner applies every
  save before the step's disk loads and offloads (which may write ``s``), after the
  offloads of earlier steps into ``s`` have landed.
* **A disk slot is read or written at most once per step.**  Slots written (saves) or
  read (loads) this step are pinned until ``take_copies``: not reassigned, so a save
  never overwrites bytes a load of the same step reads, and two saves never share a slot.
  Saves go before loads, so a key saved and looked up in one step round-trips.
* **Inclusive.**  A loaded key stays on disk (LRU-touched): evicting it from the host
  again costs no write.  Keys name their KV (chained hashes), so the copy never goes stale.
* **Nothing leaks.**  Every disk slot is free or holds exactly one key; a key holds one
  slot.  Nothing here belongs to a request: an abort or preemption has nothing to
  release (the host tier's promoted blocks are released with the step, as for host hits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class DiskTier:
    """The disk pool's index (key -> slot, least recently used first) and the step's
    copies.  ``num_disk_blocks``: slots in the runner's memory-mapped file."""

    def __init__(self, num_disk_blocks: int) -> None:
        if num_disk_blocks < 1:
            raise ValueError(f"kv_offload_disk_bytes: the disk pool holds {num_disk_blocks}"
                             " blocks; it needs at least one")
        self.num_disk_blocks = num_disk_blocks
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # least recent first
        self._free: list[int] = list(range(num_disk_blocks - 1, -1, -1))
        self._pinned: set[int] = set()  # disk slots read or written this step
        # This step's copies: (host slot, disk slot) and (disk slot, host slot).
        self._save: list[tuple[int, int]] = []
        self._load: list[tuple[int, int]] = []

    # -- queries -------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def slot_of(self, key: Hashable) -> int | None:
        """The disk slot holding ``key`` (tests and debugging)."""
        return self._lru.get(key)

    def keys(self) -> list[Hashable]:
        """The keys on disk, least recently used first (tests)."""
        return list(self._lru)

    # -- host eviction -> disk -------------------------------------------------------
    def save(self, key: Hashable, host_slot: int) -> None:
        """The host tier reuses ``host_slot``, which holds ``key``: keep a copy on disk
        (a key already on disk is only marked recently used).  With every slot pinned
        this step the block is lost, as the host tier's would be."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._lru[key] = slot
        self._pinned.add(slot)
        self._save.append((host_slot, slot))

    def _take_slot(self) -> int | None:
        """A free disk slot, else the least recently used one not pinned this step."""
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():
            if slot not in self._pinned:
                del self._lru[key]
                return slot
        return None

    # -- disk -> host ----------------------------------------------------------------
    def pin(self, keys: Iterable[Hashable]) -> None:
        """Keep these keys' slots (all on disk) from being reused this step: a promotion
        pins its disk hits before it takes host slots, whose evictions save to disk."""
        for key in keys:
            self._pinned.add(self._lru[key])
            self._lru.move_to_end(key)

    def load(self, key: Hashable, host_slot: int) -> None:
        """Queue the copy of ``key`` (on disk) into ``host_slot``; the key stays on disk."""
        slot = self._lru[key]
        self._lru.move_to_end(key)
        self._pinned.add(slot)
        self._load.append((slot, host_slot))

    # -- the step's copies -----------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies queued since the last call: ``(saves (host slot, disk slot),
        loads (disk slot, host slot))``; unpins every slot (ends the step)."""
        save, self._save = self._save, []
        load, self._load = self._load, []
        self._pinned.clear()
        return save, load

    def reset(self) -> None:
        """Forget every key (``reset_prefix_cache``, between steps)."""
        self._lru.clear()
        self._free = list(range(self.num_disk_blocks - 1, -1, -1))
        self._pinned.clear()

    def check_invariants(self) -> None:
        """Every slot free or holding one key; this step's copies read and write
        distinct slots (tests)."""
        slots = sorted([*self._free, *self._lru.values()])
        assert slots == list(range(self.num_disk_blocks)), "disk slot leaked or doubled"
        written = [d for _, d in self._save]
        assert len(set(written)) == len(written), "two saves into one disk slot"
        hosts = [h for _, h in self._load]
        assert len(set(hosts)) == len(hosts), "two disk loads into one host slot"
