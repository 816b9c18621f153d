"""The latent-space MLA decode kernel (kernels/mla_decode.py) against its torch oracle
``mla_decode_ref``: ragged block tables, contexts that are not whole blocks, the
split-KV path and its merge, multi-token (speculative) queries, head counts that are
not a power of two, bf16 and fp32.  Interpreted shapes stay tiny (L = 64, R = 16)."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, assert_close

from pagedllm.kernels.mla_decode import (
    MlaLaunch,
    mla_decode,
    mla_decode_ref,
    plan_mla_decode,
)

LAT, ROPE = 64, 16


def _batch(q_lens: list[int], seq_lens: list[int], heads: int, dtype: torch.dtype,
           seed: int, block_size: int = 16):
    """Random queries and a cache whose blocks are scattered (a shuffled pool with
    spare blocks), each request's table padded with junk ids past its last block."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 5
    cache = torch.randn(1, num_blocks, block_size, 1, LAT + ROPE, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(per_req) + 2
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)
    used = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = perm[used:used + n]
        used += n
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, LAT, generator=g)
    q_pe = torch.randn(t, heads, ROPE, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0)

    def dev(x: torch.Tensor, dt: torch.dtype = dtype) -> torch.Tensor:
        return x.to(device=DEVICE, dtype=dt)

    return (dev(q_lat), dev(q_pe), dev(cache), dev(tables, torch.int32),
            dev(torch.tensor(seq_lens), torch.int32), dev(qsl, torch.int32))


def _check(q_lens, seq_lens, heads, dtype, launch, seed):
    args = _batch(q_lens, seq_lens, heads, dtype, seed)
    scale = (LAT + ROPE) ** -0.5
    got = mla_decode(*args, scale, max(q_lens), launch=launch)
    ref = mla_decode_ref(*(a.cpu().float() for a in args[:3]),
                         *(a.cpu() for a in args[3:]), scale)
    assert got.dtype == dtype and got.shape == ref.shape
    assert_close(got, ref, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_ragged(dtype: torch.dtype, splits: int) -> None:
    """One query per request; contexts of 1, 17, 40 and 33 positions over 16-slot blocks
    (partial last blocks), tiles of 16 so the splits get uneven, some empty ones."""
    launch = MlaLaunch(block_h=16, block_q=1, block_n=16, num_splits=splits)
    _check([1, 1, 1, 1], [1, 17, 40, 33], 4, dtype, launch, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", [
    MlaLaunch(block_h=16, block_q=4, block_n=16, num_splits=1),
    MlaLaunch(block_h=16, block_q=2, block_n=16, num_splits=2),  # two query blocks
    MlaLaunch(block_h=16, block_q=1, block_n=16, num_splits=2),  # a chunk step's plan
], ids=["one-block", "qblocks-split", "one-query-split"])
def test_multi_token_queries(dtype: torch.dtype, launch: MlaLaunch) -> None:
    """Speculative-verify / short-chunk shapes: 3, 1, 4, 2 and 1 new tokens, the causal
    mask inside the query block (a query whose whole request is new: 4 of 4); one query
    a program is the plan of chunk steps (over ``MAX_TILED_QUERY_LEN`` tokens)."""
    _check([3, 1, 4, 2, 1], [21, 9, 4, 38, 17], 4, dtype, launch, seed=2)


def test_heads_over_two_blocks() -> None:
    """20 heads in 16-head blocks: the second block is mostly padding rows."""
    launch = MlaLaunch(block_h=16, block_q=1, block_n=16, num_splits=2)
    _check([1, 2], [30, 7], 20, torch.float32, launch, seed=3)


def test_planned_launch() -> None:
    """The default plan (BLOCK_N 64 at this latent width, splits from the batch)."""
    args = _batch([1, 1, 2], [70, 3, 65], 4, torch.float32, seed=4)
    got = mla_decode(*args, 0.1, 2)
    ref = mla_decode_ref(*(a.cpu() for a in args), 0.1)
    assert_close(got, ref, torch.float32, 4)


def test_plan() -> None:
    """Host-only plan: V2-Lite decode at batch 64 splits to 2 programs per SM; V3's
    128 heads use 64-head blocks; a 2-token verify packs both tokens in one program, a
    chunk step does not."""
    p = plan_mla_decode(num_reqs=64, max_query_len=1, num_heads=16, kv_lora_rank=512)
    assert (p.block_h, p.block_q, p.num_splits) == (16, 1, 4)
    p = plan_mla_decode(num_reqs=256, max_query_len=1, num_heads=128, kv_lora_rank=512)
    assert (p.block_h, p.num_splits) == (64, 1)
    p = plan_mla_decode(num_reqs=8, max_query_len=2, num_heads=16, kv_lora_rank=512,
                        max_seq_len=100)
    assert (p.block_q, p.num_splits) == (2, 1)
    # A chunk graph's launch (its token count as max_query_len): one query a program.
    p = plan_mla_decode(num_reqs=256, max_query_len=512, num_heads=16, kv_lora_rank=512)
    assert (p.block_q, p.num_splits, p.num_warps) == (1, 1, 4)


def test_agrees_with_the_model_backend() -> None:
    """The model's own absorbed-form torch path (``attention/mla_torch.py``, SDPA per
    request) is a second oracle: multi-token queries with a context offset."""
    from pagedllm.attention.mla_torch import MLADims, MLATorchBackend

    q_lens, seq_lens = [3, 1, 2], [21, 9, 38]
    q_lat, q_pe, cache, tables, seq, qsl = _batch(q_lens, seq_lens, 4, torch.float32, 7)
    scale = 0.1
    got = mla_decode(q_lat, q_pe, cache, tables, seq, qsl, scale, 3).cpu()
    dims = MLADims(num_heads=4, kv_lora_rank=LAT, qk_nope_head_dim=8, qk_rope_head_dim=ROPE,
                   v_head_dim=8)
    bs = cache.shape[2]
    for r, (n, s) in enumerate(zip(q_lens, seq_lens)):
        lo = sum(q_lens[:r])
        latent = cache.cpu()[0, tables.cpu()[r, :-(-s // bs)].long()].flatten(0, 1)[:s, 0]
        ref = MLATorchBackend._attend_latent(q_lat[lo:lo + n].cpu(), q_pe[lo:lo + n].cpu(),
                                             latent, dims, scale)
        assert_close(got[lo:lo + n], ref, torch.float32, 7)


@pytest.mark.parametrize("splits", [1, 2])
def test_padded_rows_and_strided_queries(splits: int) -> None:
    """A padded batch (two rows past ``query_start_loc[-1]``, as a CUDA graph's) leaves
    those rows as they were; queries may be strided views (a bmm's transposed output)
    and ``out`` preallocated.  A query of another dtype than the cache is refused."""
    q_lat, q_pe, cache, tables, seq, qsl = _batch([1, 1, 1], [5, 33, 18], 4,
                                                   torch.float32, seed=8)
    pad_lat = torch.cat((q_lat, q_lat[:2])).transpose(0, 1).contiguous().transpose(0, 1)
    pad_pe = torch.cat((q_pe, q_pe[:2]))
    out = torch.full((5, 4, LAT), 7.0, device=DEVICE)
    launch = MlaLaunch(block_h=16, block_q=1, block_n=16, num_splits=splits)
    mla_decode(pad_lat, pad_pe, cache, tables, seq, qsl, 0.1, 1, launch=launch, out=out)
    ref = mla_decode_ref(q_lat.cpu(), q_pe.cpu(), cache.cpu(), tables.cpu(), seq.cpu(),
                         qsl.cpu(), 0.1)
    assert_close(out[:3], ref, torch.float32, 8)
    assert bool((out[3:] == 7.0).all())
    with pytest.raises(ValueError, match="dtype"):
        mla_decode(q_lat.to(torch.bfloat16), q_pe, cache, tables, seq, qsl, 0.1, 1)


@pytest.mark.parametrize("splits", [1, 2])
def test_graph_chunk_step_searches_query_tiles(splits: int) -> None:
    """A CUDA graph's chunk step (``MLATorchBackend._graph_step``): ``max_query_len`` is
    the graph's row count, so the query tiles of every request sit on one axis and each
    program searches its request.  A prompt chunk of 9 over cached context, a decode, a
    chunk of 5, two empty request slots and five padding rows: the real rows equal the
    reference, the padding rows are left as they were."""
    q_lens, seq_lens = [9, 1, 5, 0, 0], [30, 12, 5, 1, 1]
    q_lat, q_pe, cache, tables, seq, qsl = _batch(q_lens, seq_lens, 4, torch.float32,
                                                   seed=9)
    t = sum(q_lens)
    pad = 5
    pad_lat = torch.cat((q_lat, q_lat[:pad]))
    pad_pe = torch.cat((q_pe, q_pe[:pad]))
    out = torch.full((t + pad, 4, LAT), 7.0, device=DEVICE)
    launch = MlaLaunch(block_h=16, block_q=4, block_n=16, num_splits=splits)
    mla_decode(pad_lat, pad_pe, cache, tables, seq, qsl, 0.1, t + pad, launch=launch,
               out=out)
    ref = mla_decode_ref(q_lat.cpu(), q_pe.cpu(), cache.cpu(), tables.cpu(), seq.cpu(),
                         qsl.cpu(), 0.1)
    assert_close(out[:t], ref, torch.float32, 9)
    assert bool((out[t:] == 7.0).all())


def test_chunk_step_bench_smoke(tmp_path) -> None:
    """``benchmarks/mla_fp8_bench.py --chunk``: a chunk graph's padded step (decodes and a
    chunk over cached tokens) builds, and its default plan and the sweep's grid all
    equal the oracle under the interpreter (exit status 0)."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "mla_fp8_bench.py"), "--smoke",
         "--sections", "mla", "--chunk", "5", "--chunk-prior", "7", "--graph-tokens", "16",
         "--slots", "8", "--sweep"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 wrong result(s)" in r.stdout
