"""Gated MLP activations: ``[T, 2*I] -> [T, I]``.

``silu_and_mul``: ``out = silu(x[:, :I]) * x[:, I:]`` (Llama and most models);
``gelu_tanh_and_mul``: ``out = gelu_tanh(x[:, :I]) * x[:, I:]`` (Gemma).  Rounding
follows ``act(gate) * up`` in the model dtype (the activation computed in fp32 and
rounded, then the product rounded), so a bf16 model matches Hugging Face up to the last
fp32 bits of ``exp`` -- almost always bit-identical after rounding to bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, pdl_start


@triton.jit
def silu_mul_tile(gate, up):
    """``silu(gate) * up`` for loaded tiles in the model dtype, rounded as ``F.silu(gate)
    * up`` rounds (silu in fp32 -> dtype, then the product -> dtype), returned in that
    dtype.  Every kernel that computes the activation (this one, the batch-1 GEMV that
    fuses it) does it here, so fused and unfused paths agree bit for bit."""
    g = gate.to(tl.float32)
    # silu(g) = g * sigmoid(g), written with an explicit division (as torch does) rather
    # than an approximate reciprocal.
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def gelu_tanh_mul_tile(gate, up):
    """``gelu(gate, approximate="tanh") * up``, rounded as ``silu_mul_tile``.  ``0.5 g (1 +
    tanh(u))`` is written ``g / (1 + exp(-2u))`` (the same function): no ``1 + tanh``
    cancellation for negative ``g``, and no tanh, which the interpreter lacks."""
    g = gate.to(tl.float32)
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
    act = tl.div_rn(g, 1.0 + tl.exp(-2.0 * u)).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr, GELU_TANH: tl.constexpr = False):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    if GELU_TANH:
        out = gelu_tanh_mul_tile(gate, up)
    else:
        out = silu_mul_tile(gate, up)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x``: ``[..., 2*I]`` (last dim contiguous; rows may be strided) -> ``[..., I]``."""
    return _act_and_mul(x, out, False)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`silu_and_mul` with ``gelu(gate, approximate="tanh")``."""
    return _act_and_mul(x, out, True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, inter)
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block,
                               num_warps=4 if block >= 512 else 2, GELU_TANH=gelu_tanh,
                               **pdl_launch_args(x.device))
    return out
