"""The hybrid KV cache manager (one block table per KV cache group, one pool): layer
grouping as vLLM does it, a sliding group holding only its window, prefix hits that hold
in every group, swap, forks, and -- over a random workload -- no block ever leaked or
double-counted."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS, W = 4, 10
WINDOW_BLOCKS = -(-W // BS) + 1  # the most a decoding request holds in a sliding group


def _gemma3(num_layers: int, window: int = W) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_grouping_follows_vllm() -> None:
    g = make_kv_cache_groups(_gemma3(48, 1024))  # Gemma-3-12B: 8 full, 40 sliding
    assert [len(s.layer_ids) for s in g.groups] == [8] * 6
    assert [s.sliding_window for s in g.groups] == [None] + [1024] * 5
    assert g.num_tensors == 8 and g.groups[0].layer_ids == tuple(range(5, 48, 6))
    # Each tensor is shared by exactly one layer of each group.
    assert Counter(zip(g.layer_group, g.layer_tensor)) == Counter(
        {(gi, t): 1 for gi in range(6) for t in range(8)})
    g27 = make_kv_cache_groups(_gemma3(62, 1024))  # 10 full, 52 sliding: a short group
    assert [len(s.layer_ids) for s in g27.groups] == [10] * 6 + [2]
    off = make_kv_cache_groups(_gemma3(48, 1024), hybrid=False)
    assert not off.hybrid and off.num_tensors == 48 and off.groups[0].sliding_window is None
    mistral = make_kv_cache_groups([4096] * 32)
    assert not mistral.hybrid and mistral.groups[0].sliding_window == 4096


def _req(rid: str, tokens: list[int]) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    return Request(rid, list(tokens), sp, eos_token_id=None)


def _manager(num_blocks: int = 200, layers: int = 4) -> HybridKVCacheManager:
    """``layers`` 4: a full group and three sliding ones; 2: one of each."""
    groups = make_kv_cache_groups([W, W, W, None] if layers == 4 else [W, None])
    return HybridKVCacheManager(num_blocks, BS, groups, enable_caching=True,
                                max_num_batched_tokens=16)


def _check_refcounts(kv: HybridKVCacheManager) -> None:
    """Every block's ref_cnt is the number of tables holding it; nothing else is taken."""
    held: Counter[int] = Counter()
    owner: dict[int, int] = {}
    for g, m in enumerate(kv.managers):
        for blocks in m.req_to_blocks.values():
            ids = [b.block_id for b in blocks if b is not kv.pool.null_block]
            held.update(ids)
            for i in ids:  # a block holds one group's layers' KV: never in two groups
                assert owner.setdefault(i, g) == g, (i, owner[i], g)
    for b in kv.pool.blocks[1:]:
        assert b.ref_cnt == held[b.block_id], b
    assert kv.num_free_blocks == kv.num_usable_blocks - len(held)


def _live(kv: HybridKVCacheManager, g: int, rid: str) -> int:
    return sum(1 for i in kv.managers[g].get_block_ids(rid) if i != 0)


def test_decode_holds_the_window_in_sliding_groups_only() -> None:
    kv = _manager()
    r = _req("a", list(range(1, 24)))
    assert kv.allocate_slots(r, 23) is not None
    r.num_computed_tokens = 23
    for t in range(50):
        r.append_output_token_id(500 + t)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        for g in (1, 2, 3):  # the three sliding groups (group 0 is the full one)
            assert _live(kv, g, "a") <= WINDOW_BLOCKS
            ids = kv.managers[g].get_block_ids("a")
            lo = max(0, r.num_computed_tokens - 1 - W + 1) // BS
            assert all(i != 0 for i in ids[lo:])  # every block a query may read
        assert _live(kv, 0, "a") == -(-r.num_computed_tokens // BS)
        _check_refcounts(kv)
    kv.free(r)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_hit_holds_in_every_group() -> None:
    kv = _manager()
    prompt = list(range(1, 31))
    a = _req("a", prompt)
    kv.allocate_slots(a, 30)
    a.num_computed_tokens = 30
    kv.free(a)  # freed blocks keep their hashes (the sliding groups' too)
    b = _req("b", prompt)
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 28 and all(len(h) == 7 for h in hits)
    assert 0 not in [x.block_id for x in hits[0]]  # full: the whole prefix
    lo = (28 - W + 1) // BS
    for h in hits[1:]:  # sliding: only the window before position 28
        assert [x.block_id == 0 for x in h] == [True] * lo + [False] * (7 - lo)
    assert kv.allocate_slots(b, 2, hits) is not None
    b.num_computed_tokens = 30
    _check_refcounts(kv)
    # Evict one sliding group's block inside the window: the hit shrinks in every group.
    c = _req("c", prompt)
    victim = kv.managers[2].get_block_ids("b")[5]
    kv.free(b)
    kv.pool.evict_hash(kv.pool.blocks[victim])
    hits, n_hit = kv.get_computed_blocks(c)
    assert n_hit < 28 and len({len(h) for h in hits}) == 1 and n_hit == len(hits[0]) * BS
    for h, m in zip(hits, kv.managers):  # a consistent hit: its own find agrees
        assert len(m.find_longest_cache_hit(c, n_hit // BS)) == len(h)
    assert kv.allocate_slots(c, 30 - n_hit, hits) is not None
    kv.free(c)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_all_or_nothing_and_swap_round_trip() -> None:
    kv = _manager(num_blocks=12, layers=2)  # 11 usable blocks
    a = _req("a", list(range(1, 41)))
    assert kv.allocate_slots(a, 40) is None  # 10 full + 10 sliding > 11: nothing taken
    assert kv.num_free_blocks == 11
    assert kv.allocate_slots(a, 16) is not None  # 4 + 4
    a.num_computed_tokens = 16
    # 24 tokens: 2 more full blocks and 2 sliding ones, 4 > 3 free -- but the block
    # that left the window (positions < 16 - W + 1) goes back first.
    assert kv.allocate_slots(a, 8) is not None and kv.num_free_blocks == 0
    a.num_computed_tokens = 24
    lo = (24 - W + 1) // BS
    n = kv.num_swap_blocks(a)
    assert n == 6 + (6 - lo)  # full: 6; sliding: the window's
    ids = kv.swap_out(a)
    assert len(ids) == n == len(set(ids)) and kv.num_free_blocks == 11
    back = kv.swap_in(a, 4)  # room for 4 more tokens: a 7th block in each group
    assert back is not None and len(back) == n + 2
    assert kv.managers[1].get_block_ids("a")[:lo] == [0] * lo
    assert 0 not in kv.managers[1].get_block_ids("a")[lo:]
    _check_refcounts(kv)
    kv.free(a)
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_leaks_nothing(seed: int) -> None:
    """Chunked prefills, decodes, shared prefixes, forks (copy on write) and frees in a
    random order: ref counts stay exact, sliding groups stay within their window, and
    the pool is whole again at the end."""
    rng = random.Random(seed)
    kv = _manager(num_blocks=90)  # small: new blocks evict cached ones
    live: dict[str, Request] = {}
    shared = [rng.randrange(1, 50) for _ in range(24)]
    hit_tokens = forks = 0
    for step in range(300):
        op = rng.random()
        if op < 0.15 or not live:
            rid = f"r{step}"
            r = _req(rid, shared[:rng.randrange(0, 25)] +
                     [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))])
            hits, n_hit = kv.get_computed_blocks(r)
            r.num_computed_tokens = 0
            n = min(r.num_tokens - n_hit, 16)
            if kv.allocate_slots(r, n, hits) is not None:
                r.num_computed_tokens = n_hit + n
                live[rid] = r
                hit_tokens += n_hit
        elif op < 0.25:
            kv.free(live.pop(rng.choice(sorted(live))))
        elif op < 0.3:
            parent = live[rng.choice(sorted(live))]
            if parent.num_computed_tokens == parent.num_tokens:
                child = parent.fork(f"f{step}")
                kv.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                live[child.request_id] = child
                forks += 1
        else:
            r = live[rng.choice(sorted(live))]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_id(rng.randrange(1, 50))
            n = min(r.num_tokens - r.num_computed_tokens, 16)
            if kv.allocate_slots(r, n) is not None:
                kv.take_cow(r.request_id)
                kv.take_group_updates(r.request_id)
                r.num_computed_tokens += n
                if n == 1:
                    for g in (1, 2, 3):
                        assert _live(kv, g, r.request_id) <= WINDOW_BLOCKS
        _check_refcounts(kv)
    for r in live.values():
        kv.free(r)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert hit_tokens > 0 and forks > 0
