"""The KV cache manager with a sliding window: blocks wholly behind every query's window
go back to the pool (the table entry becomes the null block), the blocks of the live
window stay private to the request, prefix-cache hits and forks still work, and freeing
returns every block."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS, W = 4, 10


def _req(rid: str, n: int, first: int = 1) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    return Request(rid, list(range(first, first + n)), sp, eos_token_id=None)


def _step(kv: KVCacheManager, r: Request, n: int, hits=None) -> None:
    assert kv.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += n + (len(hits) * BS if hits else 0)


def _live(kv: KVCacheManager, rid: str) -> list[int]:
    return [b for b in kv.get_block_ids(rid) if b != 0]


def test_decode_holds_only_the_window() -> None:
    kv = KVCacheManager(64, BS, enable_caching=True, sliding_window=W)
    r = _req("a", 23)
    _step(kv, r, 23)  # the prefill holds all its blocks while it runs
    assert len(_live(kv, "a")) == 6
    for t in range(60):
        r.append_output_token_id(100 + t)
        _step(kv, r, 1)
        first = r.num_computed_tokens - 1  # the position this decode wrote
        ids = kv.get_block_ids("a")
        # Every block a query at `first` may read is live; everything before is null.
        lo = max(0, first - W + 1) // BS
        assert all(b != 0 for b in ids[lo:]) and all(b == 0 for b in ids[:lo])
        assert len(_live(kv, "a")) <= -(-W // BS) + 1
    kv.free(r)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_hits_and_forks_with_a_window() -> None:
    kv = KVCacheManager(64, BS, enable_caching=True, sliding_window=W)
    a = _req("a", 30)
    _step(kv, a, 30)
    kv.free(a)  # freed blocks keep their hashes
    b = _req("b", 30)
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 28  # all full blocks but the last token's
    _step(kv, b, 2, hits)
    ids = kv.get_block_ids("b")
    assert ids[:4] == [0] * 4 and all(i != 0 for i in ids[4:])  # 28 - 10 + 1 -> block 4
    c = _req("c", 30)
    kv.fork(b, c)
    c.num_computed_tokens = b.num_computed_tokens
    assert kv.get_block_ids("c") == ids
    for req in (b, c):
        kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks
