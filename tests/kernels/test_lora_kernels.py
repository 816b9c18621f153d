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
