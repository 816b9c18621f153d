"""KV cache manager: which blocks each request holds, and the prefix cache.

```
 request r:  tokens  [t0 .. t15][t16 .. t31][t32 .. t37 ____]
 block table [   7   ][   2    ][   9  (partly filled)  ]      <- req_to_blocks[r]
 hashes      [  h0   ][ h1=H(h0, t16..t31) ]                  <- full blocks only
```

Internal fragmentation is at most one partly filled block per request: a request holds
``ceil(tokens / block_size)`` blocks, never more.  Block hashes are chained
(``H(parent_hash, tokens, extra_keys)``), so equal hashes mean equal *prefixes*, and are
computed once per block as it fills -- never per step over the whole sequence.

Sharing and copy-on-write (n > 1 samples, beam search):

```
 fork(parent, child):          parent  [ 7 ][ 2 ][ 9 (partial) ]      ref counts 2, 2, 2
                               child   [ 7 ][ 2 ][ 9 (partial) ]
 child appends a token:        child   [ 7 ][ 2 ][ 4 ]   <- 4 = copy of 9, then written
                               copy (9 -> 4) emitted for the runner; 9 back to ref 1
```

A block is written only at positions ``>= num_computed_tokens``; the block holding the
first such position is the only one that can be shared (later ones are new), so
``allocate_slots`` checks that one block: shared (``ref_cnt > 1``) -> copy on write.
Full blocks are never written again, so prefix-cache sharing never needs a copy.

Sliding window (every layer attends to the last ``W`` keys only, e.g. Mistral v0.1):
a block whose positions are all below ``first_position - W + 1`` of the step being
allocated is never read again, so it goes back to the pool (cached hash kept, as for any
freed block) and its table entry becomes the null block::

 W = 20, bs = 16, step writes position 70:   [null][null][ 9 ][ 4 ][ 6 ]
                                             keys 51..70 live in blocks 3..4 -- and 2,
                                             the block of position 51 - 16 < 48: kept

Attention masks keys outside the window, so the null entries are never read into a
softmax (the runner's copy of the table may keep the old ids: masked too).  Stream
order makes an in-flight step's reads finish before a later step reuses the block.
A prefix-cache hit under a window needs only the blocks inside the window of the hit's
end (``find_longest_cache_hit``); those before it come back as null entries.

Models mixing sliding and full layers (Gemma) run one manager like this per KV cache
group, all sharing one pool (``core/hybrid_kv_cache_manager.py``): ``group_id`` keeps
the groups' prefix-cache entries apart, and the groups share the memoised hashes.

Swap: ``swap_out`` releases a request's GPU blocks (their ids are returned for the copy to
CPU) but keeps its hashes; ``swap_in`` allocates fresh blocks for the copy back.
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.multimodal.hashing import block_extra_key
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...],
               extra_key: object = None) -> int:
    """Chained hash of one full block.  Python's tuple hash is deterministic for ints
    (no per-process salt), which is all an in-process cache needs."""
    return hash((parent_hash, token_ids, extra_key))


def prefix_extra_key(sampling_params: object, lora_request: object) -> object:
    """What besides the tokens decides a block's KV: the cache salt and the LoRA
    adapter (the same tokens under another adapter have other K/V)."""
    salt = getattr(sampling_params, "cache_salt", None)
    lora_id = getattr(lora_request, "lora_int_id", None)
    return salt if lora_id is None else (salt, "lora", lora_id)


class KVCacheManager:
    """Owns request -> blocks and request -> block hashes; the scheduler asks, never edits."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None, *, pool: BlockPool | None = None,
                 group_id: int = 0,
                 req_to_hashes: dict[str, list[int]] | None = None) -> None:
        """``pool``, ``group_id``, ``req_to_hashes``: set by the hybrid manager, whose
        groups share one pool (``num_blocks`` is then ignored) and one hash memo."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        # Leading table entries already returned for having left the window.
        self.num_windowed: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[int]] = \
            req_to_hashes if req_to_hashes is not None else {}
        # How many leading blocks of a request are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters (tokens), read and reset by the scheduler each step.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Copy-on-write done this step, per request: (table index, src id, dst id).
        self._cow: dict[str, list[tuple[int, int, int]]] = {}

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache --------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's chained hashes for its first ``num_full_blocks`` blocks,
        extending the memoised list only by the blocks not hashed yet."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        extra = prefix_extra_key(request.sampling_params, request.lora_request)
        mm = request.mm_features  # images: their identifiers join their blocks' keys
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            key = block_extra_key(extra, mm, i * bs, (i + 1) * bs) if mm else extra
            hashes.append(hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]), key))
        return hashes

    def _key(self, block_hash: int) -> Hashable:
        """The pool's cache key of a block hash: the hash itself in group 0, paired with
        the group id in the others (the same tokens have other KV in other layers)."""
        return block_hash if self.group_id == 0 else (self.group_id, block_hash)

    def block_keys(self, request: Request, num_blocks: int) -> list[Hashable]:
        """The pool's cache keys of ``request``'s first ``num_blocks`` full blocks (the
        prefix cache's host tier looks them up, core/offload_tier.py)."""
        return [self._key(h) for h in self._block_hashes(request, num_blocks)[:num_blocks]]

    def wants_prefix_lookup(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position: no hits.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks for a request not yet holding blocks.

        Returns the blocks (not yet referenced: pass them to ``allocate_slots``) and the
        number of tokens they cover.  At least the last token is always left to compute,
        because its logits are needed.  Counted in the stats by ``record_prefix_lookup``.
        """
        if not self.wants_prefix_lookup(request):
            return [], 0
        hits = self.find_longest_cache_hit(request, (request.num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def find_longest_cache_hit(self, request: Request,
                               max_blocks: int) -> list[KVCacheBlock]:
        """The table of the longest hit of at most ``max_blocks`` blocks (its length is
        the hit).  Full attention: the longest cached prefix.  Sliding window ``W``
        (vLLM's ``SlidingWindowManager``): a hit of ``n`` blocks needs only the blocks
        that the query at position ``n * bs`` can see, ``[(n*bs - W + 1) // bs, n)``;
        the entries before them are the null block::

            W = 10, bs = 4:  cached  [x][ ][x][x][x][x]      n = 6 needs blocks 4, 5
                             hit     [0][0][0][0][x][x]      (6 blocks, 24 tokens)
        """
        hashes = self._block_hashes(request, max_blocks)
        pool = self.pool
        if self.sliding_window is None:
            hits: list[KVCacheBlock] = []
            for h in hashes[:max_blocks]:
                b = pool.get_cached_block(self._key(h))
                if b is None:
                    break
                hits.append(b)
            return hits
        bs, w = self.block_size, self.sliding_window
        found = [pool.get_cached_block(self._key(h)) for h in hashes[:max_blocks]]
        run = 0  # cached blocks ending at block n - 1
        best = 0
        for n in range(1, max_blocks + 1):
            run = run + 1 if found[n - 1] is not None else 0
            if run >= n - max(0, n * bs - w + 1) // bs:
                best = n
        lo = max(0, best * bs - w + 1) // bs
        return [pool.null_block] * lo + found[lo:best]  # type: ignore[list-item]

    # -- allocation ----------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       hits_touched: bool = False) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (only
        on a request's first allocation).  Returns the blocks appended to the request's
        table (hits first), or None -- changing nothing -- if the pool is too small now.
        If the first block written is shared, it is copied on write first (see
        ``take_cow``).  ``hits_touched``: the caller (the hybrid manager) already took
        the hits' references, so that no group's new blocks can evict another's hits,
        and checked that every group's blocks fit.
        """
        if not new_computed_blocks and self.nothing_to_allocate(request, num_new_tokens):
            return []
        return self._allocate_slots(request, num_new_tokens, new_computed_blocks or [],
                                    hits_touched)

    def nothing_to_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """The fast path, the steady decode step: the request's last block still has
        room (a block fills only every ``block_size`` tokens), the block written first
        is its own, and no block fills up this step -- nothing to allocate, copy or
        cache (blocks that left the window are still given back).  (``num_computed <
        total <= len(blocks) * bs``, so the block written first exists.)"""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks or num_new_tokens <= 0:
            return False
        bs = self.block_size
        num_computed = request.num_computed_tokens
        total = num_computed + num_new_tokens
        if (total <= len(blocks) * bs and blocks[num_computed // bs].ref_cnt == 1
                and (not self.enable_caching or self.num_cached_blocks.get(rid, 0)
                     >= min(total, request.num_tokens) // bs)):
            if self.sliding_window is not None:
                self._free_outside_window(rid, blocks, num_computed)
            return True
        return False

    def _allocate_slots(self, request: Request, num_new_tokens: int,
                        computed: list[KVCacheBlock],
                        hits_touched: bool = False) -> list[KVCacheBlock] | None:
        """``allocate_slots`` in full: new blocks, prefix hits, copy-on-write, caching."""
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(blocks) - len(computed))
        first = num_computed // self.block_size
        cow = num_new_tokens > 0 and first < len(blocks) and blocks[first].ref_cnt > 1
        if not hits_touched and self.num_blocks_to_allocate(
                request, num_new_tokens, computed) > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        if cow:
            # Another sequence still reads this block: write into a private copy.
            (copy,) = self.pool.get_new_blocks(1)
            shared = blocks[first]
            blocks[first] = copy
            self.pool.free_blocks([shared])  # drops our reference only (ref_cnt > 1)
            self._cow.setdefault(rid, []).append((first, shared.block_id, copy.block_id))
        if computed:
            if not hits_touched:  # (before taking new blocks: they could evict a hit)
                null = self.pool.null_block
                self.pool.touch(b for b in computed if b is not null)
            blocks.extend(computed)
        new = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new)
        if self.enable_caching:
            # Register the blocks this step fills completely with known tokens.
            self._cache_full_blocks(request, min(total, request.num_tokens))
        if self.sliding_window is not None:
            self._free_outside_window(rid, blocks, num_computed)
        return computed + new if computed else new

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               computed: list[KVCacheBlock]) -> int:
        """Free blocks ``allocate_slots`` would take: new ones, a copy on write, and
        prefix hits revived from the free list."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = max(0, self.blocks_needed(num_computed + num_new_tokens) - len(blocks)
                   - len(computed))
        first = num_computed // self.block_size
        if num_new_tokens > 0 and first < len(blocks) and blocks[first].ref_cnt > 1:
            need += 1
        return need + sum(1 for b in computed if b.ref_cnt == 0)

    def free_outside_window(self, request: Request) -> None:
        """Sliding window: return the blocks no query from ``num_computed_tokens`` on
        can see (before a hybrid manager counts what an allocation needs)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is not None and blocks:
            self._free_outside_window(request.request_id, blocks,
                                      request.num_computed_tokens)

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock],
                             first_position: int) -> None:
        """Return the blocks no query from ``first_position`` on can see (module doc)."""
        assert self.sliding_window is not None
        keep_from = max(0, first_position - self.sliding_window + 1) // self.block_size
        start = self.num_windowed.get(rid, 0)
        if keep_from <= start:
            return
        null = self.pool.null_block
        dead = [b for b in blocks[start:keep_from] if b is not null]
        blocks[start:keep_from] = [null] * (keep_from - start)
        self.pool.free_blocks(reversed(dead))
        self.num_windowed[rid] = keep_from

    def take_cow(self, request_id: str) -> list[tuple[int, int, int]]:
        """The copy-on-write replacements made for a request since the last call:
        ``(table index, src block id, dst block id)``."""
        return self._cow.pop(request_id, []) if self._cow else []

    def take_group_updates(self, request_id: str) -> None:
        """The blocks of tables other than the first (hybrid manager only): none here."""
        return None

    def get_group_block_ids(self, request_id: str) -> None:
        """The tables other than the first (hybrid manager only): none here."""
        return None

    # -- sharing -------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (same tokens as ``parent`` so far) all of the parent's blocks,
        shared by reference count; nothing is copied until one of them writes."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.touch(b for b in blocks if b is not self.pool.null_block)
        cid = child.request_id
        self.req_to_blocks[cid] = list(blocks)
        if parent.request_id in self.num_windowed:
            self.num_windowed[cid] = self.num_windowed[parent.request_id]
        if parent.request_id in self.req_to_hashes:
            self.req_to_hashes[cid] = list(self.req_to_hashes[parent.request_id])
        if parent.request_id in self.num_cached_blocks:
            self.num_cached_blocks[cid] = self.num_cached_blocks[parent.request_id]

    # -- swap ----------------------------------------------------------------------
    def _swap_layout(self, request: Request) -> tuple[int, int]:
        """``(null entries, computed blocks)`` of a swapped table: the blocks of
        positions ``< num_computed_tokens`` that a later query can still see."""
        n = request.num_computed_tokens
        lo = 0 if self.sliding_window is None else \
            max(0, n - self.sliding_window + 1) // self.block_size
        return lo, max(0, self.blocks_needed(n) - lo)

    def num_swap_blocks(self, request: Request) -> int:
        """How many blocks ``swap_out`` moves to CPU (the window's only, sliding)."""
        self.free_outside_window(request)
        return self._swap_layout(request)[1]

    def swap_out(self, request: Request) -> list[int]:
        """Release ``request``'s blocks; returns the ids of its ``num_swap_blocks``
        computed ones for the runner to copy to CPU before anything overwrites them.
        Hashes stay memoised so ``swap_in`` can re-register the blocks."""
        lo, n = self._swap_layout(request)
        self.free_outside_window(request)
        ids = self.get_block_ids(request.request_id)[lo:lo + n]
        self._release(request, keep_hashes=True)
        return ids

    def swap_in_need(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks ``swap_in`` takes."""
        lo, n = self._swap_layout(request)
        total = request.num_computed_tokens + num_new_tokens
        return max(lo + n, self.blocks_needed(total)) - lo

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Fresh blocks for a swapped-out request: the first ``num_swap_blocks`` receive
        its CPU copy (in ``swap_out`` order), the rest make room for ``num_new_tokens``.
        None (nothing changed) if they don't fit."""
        need = self.swap_in_need(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return None
        lo = self._swap_layout(request)[0]
        blocks = self.pool.get_new_blocks(need)
        rid = request.request_id
        self.req_to_blocks[rid] = [self.pool.null_block] * lo + blocks
        self.num_cached_blocks[rid] = 0
        self.num_windowed[rid] = lo
        if self.enable_caching:
            total = request.num_computed_tokens + num_new_tokens
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_to_blocks[rid]
        for i in range(done, num_full):
            if blocks[i] is not self.pool.null_block:  # left the window uncached
                self.pool.cache_block(blocks[i], self._key(hashes[i]))
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first, so its prefix stays cached
        longest).  Idempotent: freeing a request that holds nothing is a no-op."""
        self._release(request, keep_hashes=False)

    def _release(self, request: Request, keep_hashes: bool) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        num_cached = self.num_cached_blocks.pop(rid, 0)
        self.num_windowed.pop(rid, None)
        self._cow.pop(rid, None)
        if not keep_hashes:
            self.req_to_hashes.pop(rid, None)
        if not blocks:
            return
        # Blocks were registered in the cache when allocated; those a preempted request
        # never computed hold no valid KV and must not serve hits.
        for b in blocks[request.num_computed_tokens // self.block_size:num_cached]:
            if b.block_hash is not None and b.ref_cnt == 1:
                self.pool.evict_hash(b)
        null = self.pool.null_block
        self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a lookup whose request could not be
        admitted yet is repeated later and must not count twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def take_prefix_stats(self) -> tuple[int, int]:
        q, h = self.prefix_queries, self.prefix_hits
        self.prefix_queries = self.prefix_hits = 0
        return q, h
