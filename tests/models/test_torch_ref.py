"""The torch reference paged attention vs a naive dense per-request attention.

Random KV caches and random (shuffled, non-contiguous) block tables; batches that mix
fresh prefills, chunks after cached context and decodes; GQA ratios 1/3/4; head dims
64/128; block sizes 16/32; float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_ref import TorchReferenceBackend
from tests.models.paged import build_metadata

# (cached context, new tokens) per request.
MIXED = [(0, 17), (5, 1), (40, 9), (33, 1), (0, 1), (64, 1), (20, 30), (31, 1)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _setup(reqs, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in reqs]
    num_blocks = sum(blocks_needed) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in blocks_needed:
        tables.append([perm.pop() for _ in range(n)])
    # Random (not zero) cache: stale data outside each request's range must be masked.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    meta = build_metadata([c for c, _ in reqs], [q for _, q in reqs], tables, block_size,
                          device)
    return cache.to(device=device, dtype=dtype), meta, tables


def _naive(query, cache, reqs, tables, block_size, scale):
    """Dense attention per request in float64, K/V looked up slot by slot."""
    k_flat = cache[0].reshape(-1, *cache.shape[3:]).double()
    v_flat = cache[1].reshape(-1, *cache.shape[3:]).double()
    outs, start = [], 0
    h = query.shape[1]
    for (ctx, q_len), table in zip(reqs, tables):
        seq = ctx + q_len
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(seq)], device=cache.device)
        k = k_flat[slots].repeat_interleave(h // k_flat.shape[1], dim=1)  # [S, H, D]
        v = v_flat[slots].repeat_interleave(h // v_flat.shape[1], dim=1)
        q = query[start:start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(ctx, seq, device=cache.device)[:, None]
        kpos = torch.arange(seq, device=cache.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 4])
def test_mixed_batch_matches_naive(gqa, head_dim, block_size, dtype, device) -> None:
    num_kv_heads = 2
    num_heads = num_kv_heads * gqa
    cache, meta, tables = _setup(MIXED, num_kv_heads, head_dim, block_size, dtype, device,
                                 seed=gqa * head_dim + block_size)
    n = meta.num_actual_tokens
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    scale = head_dim ** -0.5
    out = TorchReferenceBackend().forward(q, k, v, cache, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # The new keys were written where slot_mapping says.
    kv = cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(kv[0][meta.slot_mapping], k) and torch.equal(kv[1][meta.slot_mapping], v)
    ref = _naive(q, cache, MIXED, tables, block_size, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("reqs", [[(0, 1)] * 3 + [(100, 1)], [(0, 40)], [(70, 5), (3, 2)]])
def test_pure_batches(reqs) -> None:
    """All-decode (the fast path), one prefill, and chunks only."""
    cache, meta, tables = _setup(reqs, 2, 64, 16, torch.float32, "cpu", seed=len(reqs))
    n = meta.num_actual_tokens
    q = torch.randn(n, 6, 64)
    out = TorchReferenceBackend().attend(q, cache, meta, 0.125)
    torch.testing.assert_close(out.double(), _naive(q, cache, reqs, tables, 16, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_write_kv_skips_negative_slots() -> None:
    cache, meta, _ = _setup([(0, 4), (2, 1)], 1, 8, 4, torch.float32, "cpu")
    before = cache.clone()
    meta.slot_mapping[1] = -1
    k, v = torch.ones(5, 1, 8), torch.full((5, 1, 8), 2.0)
    TorchReferenceBackend().write_kv(k, v, cache, meta)
    flat = cache.view(2, -1, 1, 8)
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    assert (flat[0][written] == 1).all() and (flat[1][written] == 2).all()
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 1, 8)[:, untouched])


def test_padding_tokens_are_ignored() -> None:
    """Rows past num_actual_tokens (CUDA-graph padding, slot -1) neither write nor break."""
    reqs = [(3, 1), (0, 2)]
    cache, meta, _ = _setup(reqs, 1, 8, 4, torch.float32, "cpu")
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1, -1])])
    before = cache.clone()
    k = torch.randn(5, 1, 8)
    out = TorchReferenceBackend().forward(torch.randn(5, 2, 8), k, k, cache, meta, 0.3)
    assert out.shape == (5, 2, 8) and torch.isfinite(out[:3]).all()
    changed = (cache != before).any(-1).any(-1).view(2, -1).any(0)
    assert int(changed.sum()) == 3
