"""Triton LoRA shrink/expand against the torch reference (``lora/layers.lora_ref``)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.lora import lora_expand, lora_shrink
from pagedllm.lora.layers import lora_ref


def _case(t: int, k: int, n: int, slots: int, r: int, dtype: torch.dtype, device: str,
          ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t * 7 + k + n)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    a = torch.randn(slots, r, k, generator=g).to(device, dtype) / k ** 0.5
    bt = torch.randn(slots, r, n, generator=g).to(device, dtype)
    # Every slot, and rows without an adapter (-1), interleaved (unsorted).
    idx = torch.randint(-1, slots, (t,), generator=g).to(device, torch.int32)
    y = torch.randn(t, n, generator=g).to(device, dtype)
    return x, a, bt, idx, y


@pytest.mark.parametrize("t,k,n,slots,r", [(5, 40, 24, 3, 6), (9, 130, 70, 2, 17)])
def test_shrink_expand_match_reference(t: int, k: int, n: int, slots: int, r: int,
                                       device: str) -> None:
    x, a, bt, idx, y = _case(t, k, n, slots, r, torch.float32, device)
    want = y + lora_ref(x, idx, a, bt)
    s = lora_shrink(x, idx, a)
    assert torch.all(s[idx < 0] == 0)
    got = lora_expand(s, idx, bt, y.clone())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Rows without an adapter are left bit-for-bit alone.
    assert torch.equal(got[idx < 0], y[idx < 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_kernels_gpu_sizes(dtype: torch.dtype, device: str) -> None:
    """An 8B layer's shape (qkv: 4096 -> 6144, 3 shards of rank 16, 8 slots)."""
    x, a, bt, idx, y = _case(300, 4096, 6144, 8, 48, dtype, device)
    want = (y.float() + lora_ref(x.float(), idx, a.float(), bt.float()))
    got = lora_expand(lora_shrink(x, idx, a), idx, bt, y.clone())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` rounded as ``kernels/activation.py`` rounds it."""
    g, u = gu.chunk(2, dim=-1)
    act = (g.float() / (1 + torch.exp(-g.float()))).to(gu.dtype)
    return (act.float() * u.float()).to(gu.dtype)


@pytest.mark.parametrize("t,k,sizes,r,silu", [
    (1, 40, (24,), 6, False),          # one shard, decode row
    (5, 72, (20, 8, 8), 5, False),     # q/k/v shards, a block straddling shard bounds
    (4, 33, (40, 40), 4, True),        # gate/up shards; down's silu(gate)*up input
])
def test_fused_matches_reference(t: int, k: int, sizes: tuple[int, ...], r: int,
                                 silu: bool, device: str) -> None:
    """One launch (shrink + expand), mixed slots incl. -1, block-diagonal shards."""
    from pagedllm.kernels.lora import lora_fused

    g = torch.Generator().manual_seed(t + k)
    n_slots, n, s = 3, sum(sizes), len(sizes)
    x = torch.randn(t, 2 * k if silu else k, generator=g)
    a = torch.randn(n_slots, s * r, k, generator=g) / k ** 0.5
    bt = torch.zeros(n_slots, s * r, n)
    off = 0
    for i, size in enumerate(sizes):  # B block-diagonal over the shards
        bt[:, i * r:(i + 1) * r, off:off + size] = torch.randn(n_slots, r, size, generator=g)
        off += size
    slots = torch.tensor([-1, 2, 0, 1, 2][:t] if t > 1 else [1], dtype=torch.int32)
    y = torch.randn(t, n, generator=g)
    xin = _silu_mul(x) if silu else x
    want = lora_ref(xin, slots, a, bt)
    bounds = tuple(int(b) for b in torch.tensor(sizes).cumsum(0)[:-1])
    dev = [z.to(device) for z in (x, slots, a, bt, y)]
    # Small blocks so that programs cross shard bounds and K takes several steps.
    got = lora_fused(dev[0], dev[1], dev[2], dev[3], bounds, silu_mul=silu,
                     config=(16, 16, 1))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    added = lora_fused(dev[0], dev[1], dev[2], dev[3], bounds, y=dev[4].clone(),
                       silu_mul=silu, config=(16, 16, 1)).cpu()
    torch.testing.assert_close(added, y + want, rtol=1e-4, atol=1e-4)
    assert torch.equal(added[slots < 0], y[slots < 0])
