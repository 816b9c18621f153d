"""Gemma's norm kernel (``kernels/norm.gemma_norm``: the plain norm, the post-norm skip
connection, and post-norm + skip + next norm in one launch) and the GELU-tanh gated
activation (``kernels/activation.gelu_tanh_and_mul``) against transformers' own
``Gemma3RMSNorm`` and ``F.gelu(approximate="tanh")`` in the model dtype, rounded where
the bf16 model rounds.  Tolerances as ``test_elementwise.py`` (its module doc: the
interpreter truncates fp32 -> bf16 casts; exact to an ulp on the GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_refs import DEVICE, ON_GPU, fresh_seed
from test_elementwise import _close
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from pagedllm.kernels.activation import gelu_tanh_and_mul
from pagedllm.kernels.norm import gemma_norm

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_GPU else [])


def _hf_norm(hidden: int, gen: torch.Generator, dtype: torch.dtype) -> Gemma3RMSNorm:
    norm = Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(hidden, generator=gen))  # zero-centred
    return norm.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [256, 200])
def test_gemma_norm_modes(hidden: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    a, b = _hf_norm(hidden, gen, dtype), _hf_norm(hidden, gen, dtype)
    x = (3 * torch.randn(6, hidden, generator=gen)).to(DEVICE, dtype)
    res = torch.randn(6, hidden, generator=gen).to(DEVICE, dtype)
    with torch.no_grad():
        want = a(x)
        want_h = res + a(x)  # the decoder's skip connection, added in the model dtype
        want_next = b(want_h)
    _close(gemma_norm(x, a.weight, 1e-6), want, dtype, seed)
    # h = residual + norm(x) cancels: its error is an ulp of the operands (~1), not of h
    # (floor 2, as the rotary checks).
    _close(gemma_norm(x, a.weight, 1e-6, res), want_h, dtype, seed, floor=2.0)
    got_next, got_h = gemma_norm(x, a.weight, 1e-6, res, b.weight)
    _close(got_h, want_h, dtype, seed, floor=2.0)
    _close(got_next, want_next, dtype, seed, floor=2.0)
    # per-head q/k norms: [T, heads, head_dim] rows taken from a wider (strided) buffer
    qkv = torch.randn(6, 3 * hidden, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :2 * hidden].view(6, 2, hidden)
    with torch.no_grad():
        _close(gemma_norm(q, a.weight, 1e-6), a(q), dtype, seed)
    assert gemma_norm(x[:0], a.weight, 1e-6).shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])
def test_gelu_tanh_and_mul(inter: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(5, 2 * inter, generator=gen)).to(DEVICE, dtype)
    out = torch.full((5, inter), float("nan"), dtype=dtype, device=DEVICE)
    gelu_tanh_and_mul(x, out=out)
    if dtype == torch.float32:
        # fp32: against float64.  torch's fp32 ``0.5 g (1 + tanh u)`` loses bits to the
        # cancellation for negative g that the kernel's ``g / (1 + exp(-2u))`` avoids.
        xd = x.double()
        ref = F.gelu(xd[:, :inter], approximate="tanh") * xd[:, inter:]
    else:
        ref = F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]
    _close(out, ref, dtype, seed)
