"""Paged attention (single pass and split-KV) and the KV write against naive torch.

Under TRITON_INTERPRET the shapes are small and the grids sparse; the ``gpu``-marked
tests run real sizes (long contexts, >65k-block caches for int64 offsets).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_refs import (
    DEVICE,
    ON_GPU,
    PagedBatch,
    assert_close,
    fresh_seed,
    make_paged_batch,
    naive_attention,
    random_mixed_lens,
)

from pagedllm.kernels.kv_write import write_kv_cache
from pagedllm.kernels.paged_attention import (
    AttentionLaunch,
    paged_attention,
    plan_attention,
)

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_GPU else [])


def _check(batch: PagedBatch, out: torch.Tensor, scale: float, dtype: torch.dtype,
           seed: int) -> None:
    n = sum(batch.query_lens)
    assert_close(out[:n], naive_attention(batch, scale)[:n], dtype, seed)
    assert out[n:].isnan().all(), "padding rows must stay unwritten"


def _run(batch: PagedBatch, scale: float, **kw: object) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # poison: unwritten rows show
    res = paged_attention(
        batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
        scale=scale, out=out, **kw)  # type: ignore[arg-type]
    assert res is out
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(head_dim: int, gqa: int, block_size: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = random_mixed_lens(gen, num_decodes=2, num_chunks=1, max_ctx=70,
                                         max_chunk=20)
    num_kv_heads = 2 if gqa > 1 else 1
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=num_kv_heads * gqa,
                             num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE,
                             pad_tokens=2, gen=gen)
    scale = head_dim ** -0.5
    _check(batch, _run(batch, scale, num_splits=1), scale, dtype, seed)  # one launch
    # Default plan: decodes and prompt chunks as two launches with their own tiles.
    _check(batch, _run(batch, scale), scale, dtype, seed)


@pytest.mark.parametrize("dtype,head_dim,gqa,block_size,splits", [
    (torch.float32, 64, 4, 16, 4),
    (torch.bfloat16, 128, 1, 32, 3),
    (torch.bfloat16, 64, 4, 32, 8),
])
def test_split_kv(dtype: torch.dtype, head_dim: int, gqa: int, block_size: int,
                  splits: int) -> None:
    """Split-KV forced on, decodes plus a chunk: split ranges follow each request's own
    length, and splits that get no tiles must merge with weight 0."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = random_mixed_lens(gen, num_decodes=2, num_chunks=1, max_ctx=150,
                                         max_chunk=9)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=2 * gqa, num_kv_heads=2,
                             head_dim=head_dim, block_size=block_size, dtype=dtype,
                             device=DEVICE, pad_tokens=1, gen=gen)
    scale = 0.3
    _check(batch, _run(batch, scale, num_splits=splits), scale, dtype, seed)


def test_decode_only_heuristic_splits() -> None:
    """A small decode batch takes the split path by default (and stays correct)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    plan = plan_attention(num_reqs=2, max_query_len=1, num_heads=8, num_kv_heads=2,
                          block_size=16, sm_count=132)
    assert plan.num_splits > 1
    batch = make_paged_batch([1, 1], [100, 37], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, dtype=torch.float32, device=DEVICE, gen=gen)
    small = AttentionLaunch(plan.block_m, plan.block_q, plan.tile_n, num_splits=4)
    _check(batch, _run(batch, 0.125, launch=small), 0.125, torch.float32, seed)


def test_long_prefill_many_tiles_odd_gqa() -> None:
    """One prompt spanning several query tiles, GQA 3 (a non-power-of-two group, like
    SmolLM2's 9/3 heads) and a head size that needs padding to a power of two."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([45, 1], [7, 20], num_heads=6, num_kv_heads=2, head_dim=48,
                             block_size=16, dtype=torch.float32, device=DEVICE, gen=gen)
    launch = AttentionLaunch(block_m=16, block_q=5, tile_n=16, num_splits=1)
    _check(batch, _run(batch, 0.2, launch=launch), 0.2, torch.float32, seed)


def test_plan_is_graph_stable() -> None:
    """Without max_seq_len the plan depends on batch shape only."""
    a = plan_attention(num_reqs=8, max_query_len=1, num_heads=32, num_kv_heads=8,
                       block_size=16, sm_count=132)
    b = plan_attention(num_reqs=8, max_query_len=1, num_heads=32, num_kv_heads=8,
                       block_size=16, sm_count=132)
    assert a == b and a.num_splits > 1
    big = plan_attention(num_reqs=256, max_query_len=1, num_heads=32, num_kv_heads=8,
                         block_size=16, sm_count=132)
    assert big.num_splits == 1
    mixed = plan_attention(num_reqs=2, max_query_len=300, num_heads=32, num_kv_heads=8,
                           block_size=16, sm_count=132)
    assert mixed.num_splits == 1 and mixed.block_q * 4 == mixed.block_m


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_only_unsplit_default_plan(block_size: int) -> None:
    """A decode batch with at least one wave of programs (34 requests x 4 KV heads >= 132
    SMs) runs unsplit with the default plan's long tiles; contexts straddle tile ends."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 300, (34,), generator=gen).tolist()
    ctx[:4] = [0, 126, 127, 128]  # seq_len 1, 127, 128, 129
    plan = plan_attention(num_reqs=34, max_query_len=1, num_heads=8, num_kv_heads=4,
                          block_size=block_size, sm_count=132, head_dim=64)
    assert plan.num_splits == 1
    batch = make_paged_batch([1] * 34, ctx, num_heads=8, num_kv_heads=4, head_dim=64,
                             block_size=block_size, dtype=torch.float32, device=DEVICE,
                             pad_tokens=2, gen=gen)
    _check(batch, _run(batch, 0.125), 0.125, torch.float32, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_write(block_size: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([3, 1, 5], [0, 20, 40], num_heads=4, num_kv_heads=2,
                             head_dim=64, block_size=block_size, dtype=dtype, device=DEVICE,
                             pad_tokens=3, gen=gen)
    expected = batch.kv_cache.clone()
    cache = batch.kv_cache.clone()
    n = sum(batch.query_lens)
    slots = batch.slot_mapping[:n]
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[:, slots] = float("nan")  # poison the target slots
    # Key/value as strided views of a fused buffer, as a QKV projection would give them.
    fused = torch.cat([batch.key, batch.value], dim=1)
    write_kv_cache(fused[:, :2], fused[:, 2:], cache, batch.slot_mapping)
    assert torch.equal(cache, expected), f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim,gqa", [(64, 1), (128, 4), (128, 8), (64, 4)])
def test_gpu_grid(head_dim: int, gqa: int, block_size: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = random_mixed_lens(gen, num_decodes=24, num_chunks=6, max_ctx=3000,
                                         max_chunk=300)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=4 * gqa, num_kv_heads=4,
                             head_dim=head_dim, block_size=block_size, dtype=dtype,
                             device=DEVICE, pad_tokens=5, gen=gen)
    scale = 3 * head_dim ** -0.5  # peaky enough that outputs stay well above atol
    for splits in (1, 7, None):
        _check(batch, _run(batch, scale, num_splits=splits), scale, dtype, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None, 16])
def test_gpu_long_context_int64_offsets(splits: int | None) -> None:
    """32k-token contexts in a cache of > 65k blocks of 16 x 8 x 128: block_id *
    block_stride passes 2**31 elements, so int32 offsets would read the wrong memory."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 140_000  # 2 * 140k * 16 * 8 * 128 * 2 B = 9.2 GB (bf16)
    assert num_blocks * 16 * 8 * 128 > 2**31
    q_lens, ctx_lens = [1, 1, 1, 37], [32_767, 20_000, 5, 32_000]
    batch = _high_block_batch(q_lens, ctx_lens, num_blocks, gen)
    # scale 1 makes the softmax peaky, so the output has magnitude ~1 (an average over
    # 32k random values would be ~0.01, below bf16's atol, and hide reads of wrong blocks).
    scale = 1.0
    _check(batch, _run(batch, scale, num_splits=splits), scale, torch.bfloat16, seed)


def _high_block_batch(q_lens: list[int], ctx_lens: list[int], num_blocks: int,
                      gen: torch.Generator) -> PagedBatch:
    """Like make_paged_batch but builds the big cache on the GPU and uses the highest
    block ids (to exercise offsets past 2**31) without a host-sized random fill."""
    block_size, kvh, d = 16, 8, 128
    cache = torch.randn(2, num_blocks, block_size, kvh, d, device="cuda",
                        dtype=torch.bfloat16)
    seq_lens = [c + q for c, q in zip(q_lens, ctx_lens)]
    blocks_per = [math.ceil(s / block_size) for s in seq_lens]
    ids = (num_blocks - 1 - torch.randperm(sum(blocks_per) * 2, generator=gen))
    ids = ids[:sum(blocks_per)].tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    ctx_k, ctx_v, slots, qsl, used = [], [], [], [0], 0
    for r, s in enumerate(seq_lens):
        row = torch.tensor(ids[used:used + blocks_per[r]])
        used += blocks_per[r]
        tables[r, :len(row)] = row.to(torch.int32)
        pos = torch.arange(s, device="cuda")
        blk = row.cuda()[pos // block_size]
        ctx_k.append(cache[0, blk, pos % block_size].float())
        ctx_v.append(cache[1, blk, pos % block_size].float())
        slots.append((blk * block_size + pos % block_size)[s - q_lens[r]:])
        qsl.append(qsl[-1] + q_lens[r])
    num_tokens = qsl[-1]
    query = torch.randn(num_tokens, 32, d, generator=gen).to("cuda", torch.bfloat16)
    return PagedBatch(
        query=query, key=query[:, :kvh], value=query[:, :kvh], kv_cache=cache,
        block_tables=tables.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.cat(slots), ctx_k=ctx_k, ctx_v=ctx_v, query_lens=q_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))


@pytest.mark.gpu
def test_gpu_kv_write_high_blocks() -> None:
    """The write path with slots past 2**31 elements."""
    num_blocks, block_size, kvh, d = 140_000, 16, 8, 128
    cache = torch.zeros(2, num_blocks, block_size, kvh, d, device="cuda",
                        dtype=torch.bfloat16)
    slots = torch.tensor([num_blocks * block_size - 1, 5, -1, (num_blocks - 7) * block_size],
                         device="cuda", dtype=torch.int64)
    key = torch.randn(4, kvh, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(4, kvh, d, device="cuda", dtype=torch.bfloat16)
    write_kv_cache(key, value, cache, slots)
    flat = cache.view(2, -1, kvh, d)
    for i in (0, 1, 3):
        assert torch.equal(flat[0, slots[i]], key[i]) and torch.equal(flat[1, slots[i]], value[i])
    # Nothing else was written (the -1 slot was skipped).
    written = key[[0, 1, 3]] != 0
    assert int((flat != 0).sum()) == int(written.sum() + (value[[0, 1, 3]] != 0).sum())


@pytest.mark.parametrize("q_lens,ctx_lens,max_q,pad", [
    ([1, 3, 1], [20, 5, 9], 3, 2),  # a mixed batch: the query_start_loc search
    ([1, 1, 1], [40, 7, 90], 1, 3),  # decode only: program r is request r, no search
])
def test_padded_empty_requests(q_lens: list[int], ctx_lens: list[int], max_q: int,
                               pad: int) -> None:
    """CUDA-graph batches may pad the request list with empty requests (query_len 0,
    seq_len 0, repeated query_start_loc) and the tokens with padding rows: they must
    neither crash nor write, split or not -- also where the decode-only launch maps
    programs to requests directly."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=8, num_kv_heads=2,
                             head_dim=64, block_size=16, dtype=torch.float32,
                             device=DEVICE, pad_tokens=pad, gen=gen)
    n = sum(batch.query_lens)
    qsl = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(2)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(2)])
    tables = torch.cat([batch.block_tables,
                        batch.block_tables.new_zeros(2, batch.block_tables.shape[1])])
    ref = naive_attention(batch, 0.125)[:n]
    for splits in (1, 4):
        out = torch.full_like(batch.query, float("nan"))
        paged_attention(batch.query, batch.kv_cache, tables, seq_lens, qsl, num_reqs=5,
                        max_query_len=max_q, scale=0.125, out=out, num_splits=splits)
        assert_close(out[:n], ref, torch.float32, seed)
        assert out[n:].isnan().all(), f"padding rows written (splits={splits})"
