"""The head-major KV cache (``worker.block_ops.allocate_kv_cache``, the default on CUDA):
stored ``[2, blocks, kv_heads, block_size, dim]`` behind the usual ``[2, blocks,
block_size, kv_heads, dim]`` view.  Every kernel that touches the cache addresses it by
its strides, so on the same logical contents each gives bit-identical results in either
layout (interpreted on CPU; at real sizes on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_refs import DEVICE, fresh_seed, make_paged_batch

from pagedllm.kernels.kv_write import write_kv_cache
from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.kernels.rotary import rotary_and_write_kv
from pagedllm.worker.block_ops import kv_head_major, move_blocks


def _head_major(kv: torch.Tensor) -> torch.Tensor:
    """The same values, stored head-major (as ``allocate_kv_cache`` lays them out)."""
    hm = kv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    assert not hm.is_contiguous() and torch.equal(hm, kv)
    return hm


def _attend(batch, cache: torch.Tensor, **kw) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, cache, batch.block_tables, batch.seq_lens,
                    batch.query_start_loc, num_reqs=batch.num_reqs,
                    max_query_len=batch.max_query_len, scale=0.1, out=out, **kw)
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 9, 1, 1], [40, 23, 0, 77]),  # mixed: the one-launch mixed kernel
    ([1] * 6, [5, 130, 64, 1, 33, 90]),  # decode only (split at this batch size)
])
def test_attention_same_in_both_layouts(block_size: int, q_lens: list[int],
                                        ctx_lens: list[int]) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=block_size, dtype=torch.bfloat16, device=DEVICE,
                             pad_tokens=1, gen=gen)
    hm = dataclasses.replace(batch, kv_cache=_head_major(batch.kv_cache))
    n = sum(q_lens)
    for kw in ({}, {"num_splits": 1}):
        want = _attend(batch, batch.kv_cache, **kw)
        got = _attend(hm, hm.kv_cache, **kw)
        assert not want[:n].isnan().any(), f"seed={seed}"
        assert torch.equal(got[:n], want[:n]), f"seed={seed} {kw}"
        assert got[n:].isnan().all()


def test_kv_writes_same_in_both_layouts() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, hq, hk, d, bs, nb = 6, 4, 2, 64, 16, 6
    cache = torch.randn(2, nb, bs, hk, d, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[3] = -1  # a CUDA-graph padding token
    slots = slots.to(DEVICE)
    k = torch.randn(t, hk, d, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(t, hk, d, generator=gen).to(DEVICE, torch.bfloat16)
    plain, hm = cache.clone(), _head_major(cache)
    write_kv_cache(k, v, plain, slots)
    write_kv_cache(k, v, hm, slots)
    assert torch.equal(hm, plain) and not torch.equal(plain, cache), f"seed={seed}"

    pos = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    freqs = torch.arange(64).float()[:, None] / (10000.0 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE, torch.bfloat16)
    q2 = q.clone()
    rotary_and_write_kv(pos, q, k, v, d, cos_sin, plain, slots)
    rotary_and_write_kv(pos, q2, k, v, d, cos_sin, hm, slots)
    assert torch.equal(q2, q) and torch.equal(hm, plain), f"seed={seed}"


def test_block_moves_in_head_major_cache() -> None:
    """Swap and copy-on-write index the block dimension: layout-independent."""
    src = torch.randn(2, 5, 4, 3, 8)
    hm = _head_major(src)
    plain = src.clone()
    move_blocks([plain], [plain], [(1, 3), (3, 0)])
    move_blocks([hm], [hm], [(1, 3), (3, 0)])
    assert torch.equal(hm, plain)
    swap = torch.zeros(2, 2, 4, 3, 8)
    move_blocks([hm], [swap], [(4, 1)])
    assert torch.equal(swap[:, 1], src[:, 4])


def test_head_major_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_KV_LAYOUT", raising=False)
    assert kv_head_major(torch.device("cuda"))
    assert not kv_head_major(torch.device("cpu"))  # the torch reference views it flat
    monkeypatch.setenv("PAGEDLLM_KV_LAYOUT", "token")
    assert not kv_head_major(torch.device("cuda"))
