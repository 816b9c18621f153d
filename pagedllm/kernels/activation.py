"""SiLU-and-multiply, the gated MLP activation: ``[T, 2*I] -> [T, I]``.

``out = silu(x[:, :I]) * x[:, I:]``.  Rounding follows ``F.silu(gate) * up`` in the model
dtype (silu computed in fp32 and rounded, then the product rounded), so a bf16 model
matches Hugging Face up to the last fp32 bit of ``exp`` -- almost always bit-identical
after rounding to bf16.
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
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    out = silu_mul_tile(gate, up)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x``: ``[..., 2*I]`` (last dim contiguous; rows may be strided) -> ``[..., I]``."""
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
                               num_warps=4 if block >= 512 else 2,
                               **pdl_launch_args(x.device))
    return out
