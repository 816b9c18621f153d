"""The hybrid KV cache manager: one block table per KV cache group, one shared pool.

For models mixing full and sliding-window layers (``core/kv_cache_groups.py``), each
group gets its own ``KVCacheManager`` -- the full groups keep the whole context, the
sliding ones give back what has left their window -- and all of them take blocks from
one ``BlockPool`` (vLLM's ``HybridKVCacheCoordinator``):

```
 request r, 40 tokens, bs 4, W 10:
   group 0 (full)     [ 7][ 2][ 9][11][ 3][ 5][ 8][12][14][16]
   group 1 (sliding)  [ 0][ 0][ 0][ 0][ 0][ 0][ 4][ 6][10][13]   0 = the null block
```

The scheduler talks to it exactly as to a single ``KVCacheManager``: ``allocate_slots``
is all-or-nothing over the groups (it counts every group's need against the free pool
before taking anything) and returns the first group's new blocks; the other groups'
new block ids and copy-on-write replacements are read once per step with
``take_group_updates`` and travel to the runner beside the first group's.

Prefix caching: a hit must hold in every group at the same length.  Each group finds
its longest hit no longer than the current bound (a full group: the cached prefix; a
sliding group: the window before the hit's end, ``find_longest_cache_hit``), the bound
drops to the shortest, and this repeats until no group shortens it (a sliding group's
hit at a shorter length needs other blocks, so it is looked up again).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request


@dataclass(slots=True)
class GroupUpdates:
    """What changed in a request's tables after the first since the runner last heard:
    ``new_block_ids[g - 1]`` appended to group ``g``'s table; ``replaced``: ``(group,
    table index, new block id)`` (copy on write); ``copies``: ``(src, dst)`` block ids
    to copy before the step (with the first group's, in ``SchedulerOutput.block_copies``)."""

    new_block_ids: list[list[int]]
    replaced: list[tuple[int, int, int]]
    copies: list[tuple[int, int]]


class HybridKVCacheManager:
    """``KVCacheManager``'s interface over several groups (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, groups: KVCacheGroups,
                 enable_caching: bool = False, max_num_batched_tokens: int = 2048) -> None:
        self.block_size = block_size
        self.groups = groups
        self.enable_caching = enable_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = BlockPool(num_blocks, enable_caching)
        hashes: dict[str, list[int]] = {}  # the same tokens hash alike in every group
        self.managers = [
            KVCacheManager(num_blocks, block_size, enable_caching, g.sliding_window,
                           pool=self.pool, group_id=i, req_to_hashes=hashes)
            for i, g in enumerate(groups.groups)]
        self._first = self.managers[0]
        self._rest = self.managers[1:]
        # Sliding groups by window: groups of one window free the same table entries.
        by_window: dict[int, list[KVCacheManager]] = {}
        for m in self.managers:
            if m.sliding_window is not None:
                by_window.setdefault(m.sliding_window, []).append(m)
        self._windows = list(by_window.items())
        # New block ids of groups 1.. per request, not yet taken by the scheduler.
        self._new: dict[str, list[list[int]]] = {}
        # Requests whose tables changed since ``take_group_updates`` last looked.
        self._changed: set[str] = set()

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens may hold at once, all groups."""
        return self.groups.blocks_per_request(num_tokens, self.block_size,
                                              self.max_num_batched_tokens)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._first.get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The whole tables of groups 1.. (a request the runner is told about anew);
        pending updates are dropped, since the tables already contain them."""
        self._new.pop(request_id, None)
        self._changed.discard(request_id)
        for m in self._rest:
            m.take_cow(request_id)
        return [m.get_block_ids(request_id) for m in self._rest]

    # -- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, request: Request,
                            ) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the table of the longest hit that holds in every group, and the
        tokens it covers (see the module docstring)."""
        if not self._first.wants_prefix_lookup(request):
            return [], 0
        n = (request.num_tokens - 1) // self.block_size
        while True:
            hits = [m.find_longest_cache_hit(request, n) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if shortest == n:
                return hits, n * self.block_size
            n = shortest

    # -- allocation ----------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None,
                       ) -> list[KVCacheBlock] | None:
        """``KVCacheManager.allocate_slots`` in every group, all or nothing; returns the
        first group's new blocks (the others': ``take_group_updates``)."""
        if not new_computed_blocks and self._nothing_to_allocate(request, num_new_tokens):
            return []
        self._changed.add(request.request_id)
        computed = new_computed_blocks or [[] for _ in self.managers]
        for m in self.managers:  # what no query from here on sees goes back first
            m.free_outside_window(request)
        need = sum(m.num_blocks_to_allocate(request, num_new_tokens, c)
                   for m, c in zip(self.managers, computed))
        if need > self.pool.num_free_blocks:
            return None
        # Every group's hits are referenced before any group takes new blocks: taking
        # a free block evicts its cached hash, and it may be another group's hit.
        null = self.pool.null_block
        self.pool.touch(b for hits in computed for b in hits if b is not null)
        first = self._first.allocate_slots(request, num_new_tokens, computed[0] or None,
                                           hits_touched=True)
        assert first is not None
        rest: list[list[int]] = []
        any_new = False
        for m, c in zip(self._rest, computed[1:]):
            blocks = m.allocate_slots(request, num_new_tokens, c or None, hits_touched=True)
            assert blocks is not None
            rest.append([b.block_id for b in blocks])
            any_new = any_new or bool(blocks)
        if any_new:
            pending = self._new.get(request.request_id)
            if pending is None:
                self._new[request.request_id] = rest
            else:
                for ids, more in zip(pending, rest):
                    ids.extend(more)
        return first

    def _nothing_to_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """``KVCacheManager.nothing_to_allocate`` for every group at the cost of one.
        The groups' tables move in step: each allocation, hit, fork, swap-in and free
        gives every group the same token count, so they have the same length and cached
        count; the block written first is shared in all groups (a fork shares every
        group's) or in none (copy on write replaces it in every group at once, and it is
        never a prefix hit nor, being inside the window, the null block); and groups of
        one window have freed the same entries."""
        rid = request.request_id
        first = self._first
        blocks = first.req_to_blocks.get(rid)
        if not blocks or num_new_tokens <= 0:
            return False
        bs = self.block_size
        num_computed = request.num_computed_tokens
        total = num_computed + num_new_tokens
        if total > len(blocks) * bs or (self.enable_caching and first.num_cached_blocks.get(
                rid, 0) < min(total, request.num_tokens) // bs):
            return False
        if blocks[num_computed // bs].ref_cnt != 1:
            return False
        for w, group in self._windows:  # a block left the window: give it back
            if max(0, num_computed - w + 1) // bs > group[0].num_windowed.get(rid, 0):
                for m in group:
                    m._free_outside_window(rid, m.req_to_blocks[rid], num_computed)
        return True

    def take_cow(self, request_id: str) -> list[tuple[int, int, int]]:
        """The first group's copy-on-write replacements (``KVCacheManager.take_cow``)."""
        return self._first.take_cow(request_id)

    def take_group_updates(self, request_id: str) -> GroupUpdates | None:
        """Groups 1..: new block ids and copy-on-write since the last call (None: none)."""
        if request_id not in self._changed:
            return None  # (the steady decode step)
        self._changed.discard(request_id)
        new = self._new.pop(request_id, None)
        replaced: list[tuple[int, int, int]] = []
        copies: list[tuple[int, int]] = []
        for g, m in enumerate(self._rest, 1):
            for i, src, dst in m.take_cow(request_id):
                replaced.append((g, i, dst))
                copies.append((src, dst))
        if new is None and not replaced:
            return None
        return GroupUpdates(new or [[] for _ in self._rest], replaced, copies)

    # -- sharing -------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        for m in self.managers:
            m.fork(parent, child)

    # -- swap ----------------------------------------------------------------------
    def num_swap_blocks(self, request: Request) -> int:
        return sum(m.num_swap_blocks(request) for m in self.managers)

    def swap_out(self, request: Request) -> list[int]:
        """Every group's computed blocks, group after group (``swap_in``'s order)."""
        self._new.pop(request.request_id, None)
        self._changed.discard(request.request_id)
        return [i for m in self.managers for i in m.swap_out(request)]

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Fresh tables in every group, all or nothing.  Returns the blocks receiving
        the CPU copy first, in ``swap_out``'s order, then the other new ones."""
        if sum(m.swap_in_need(request, num_new_tokens) for m in self.managers) > \
                self.pool.num_free_blocks:
            return None
        receivers: list[KVCacheBlock] = []
        extra: list[KVCacheBlock] = []
        for m in self.managers:
            n = m.num_swap_blocks(request)
            blocks = m.swap_in(request, num_new_tokens)
            assert blocks is not None
            receivers += blocks[:n]
            extra += blocks[n:]
        return receivers + extra

    def free(self, request: Request) -> None:
        self._new.pop(request.request_id, None)
        self._changed.discard(request.request_id)
        for m in reversed(self.managers):
            m.free(request)

    # -- stats ---------------------------------------------------------------------
    @property
    def prefix_queries(self) -> int:
        return self._first.prefix_queries

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._first.record_prefix_lookup(num_tokens, num_hit_tokens)

    def take_prefix_stats(self) -> tuple[int, int]:
        return self._first.take_prefix_stats()


def make_kv_cache_manager(num_blocks: int, block_size: int, groups: KVCacheGroups | None,
                          enable_caching: bool, sliding_window: int | None,
                          max_num_batched_tokens: int,
                          ) -> KVCacheManager | HybridKVCacheManager:
    """The scheduler's KV manager: hybrid when the model has more than one group."""
    if groups is not None and groups.hybrid:
        return HybridKVCacheManager(num_blocks, block_size, groups, enable_caching,
                                    max_num_batched_tokens)
    if groups is not None:
        sliding_window = groups.groups[0].sliding_window
    return KVCacheManager(num_blocks, block_size, enable_caching, sliding_window)
