"""Per-token e4m3 quantisation of activations for the FP8 GEMM, in one launch.

For each row ``x[t, :]``: ``scale[t] = max(amax(|x[t]|) / 448, min_scale)`` and
``q[t, :] = clamp(x[t] / scale[t], -448, 448)`` rounded to e4m3 -- exactly
``layers/quantization/fp8.quantize_fp8_rows`` (the oracle).  One program per row; a row
of up to 16,384 columns is read once and kept in registers (wider rows: an amax pass,
then a quantise pass that hits L2).  The grid is the row count (a host int): CUDA-graph
safe, no host sync.

The kernel launches with PDL (``kernels/pdl.py``): the GEMM that reads its output
starts at once and fetches its first weights while this one runs.  At batch 1 that took
the Llama-3-8B FP8 W4 TPOT from 3.15 to 2.89-2.91 ms on an H200.  Where an RMSNorm
precedes the projection, the norm kernel quantises its own output instead
(``kernels/norm.rms_norm_fp8``, with this module's rounding), and this kernel is not
launched at all.  (Folding SiLU-and-mul into this kernel before ``down_proj`` was
measured too and was slower: W4 2.84 -> 2.91 ms, W1 -2%; one program per row then
computes 14,336 activations.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, pdl_start
from pagedllm.kernels.quant_common import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

# The interpreter's fp32 -> fp8 cast rounds wrongly (ties away from even, and mantissa
# carries lost: 0.494 became 0.25 in triton 3.6), so under TRITON_INTERPRET the kernels
# round by hand; on the GPU the cast is the hardware's cvt.rn.satfinite (torch's rounding).
_ROUND_BY_HAND = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_e4m3(y):
    """fp32 ``y`` -> the nearest e4m3 value (round half to even, saturated at +-448), in
    fp32 (exactly representable: the cast to fp8 that follows is exact)."""
    y = tl.clamp(y, -448.0, 448.0)
    if not _ROUND_BY_HAND:
        return y  # the hardware cast rounds
    u = y.to(tl.uint32, bitcast=True)
    # Normal e4m3 numbers keep 3 of fp32's 23 mantissa bits: round the low 20 bits off.
    normal = (((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
    # Subnormals (|y| < 2^-6) are multiples of 2^-9: adding 1.5 * 2^14 puts |y| where the
    # fp32 spacing is 2^-9, so the addition itself rounds (half to even); the sign is
    # put back from y's sign bit (tiny negatives become -0, as in torch).
    a = tl.abs(y)
    sub = (a + 24576.0) - 24576.0
    sub = tl.where((u >> 31) == 1, -sub, sub)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def row_absmax(x_ptr, row, stride_x, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    """max |x[row, :N_COLS]| in fp32: the per-token quantisers' first pass (here and in
    ``int8_gemm``)."""
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N_COLS, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < N_COLS, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, 0)


@triton.jit
def _load_row(x_ptr, row, stride_x, c, N_COLS: tl.constexpr):
    """Columns ``c`` of row ``row`` in fp32 (zeros past ``N_COLS``)."""
    return tl.load(x_ptr + row * stride_x + c, mask=c < N_COLS, other=0.0).to(tl.float32)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, min_scale,
                            N_COLS: tl.constexpr, FP8_MAX_C: tl.constexpr,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # N_COLS is compiled in: a model has a handful of linear input widths.
    # PDL: the GEMM after this kernel launches at once and fetches its first weight
    # tile while this one runs (it reads nothing before its wait: kernels/pdl.py).
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if N_COLS <= BLOCK:  # static: the row stays in registers, read once
        x = _load_row(x_ptr, row, stride_x, cols, N_COLS)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), FP8_MAX_C), min_scale)
        tl.store(s_ptr + row, scale)
        q = round_e4m3(tl.div_rn(x, scale))  # IEEE division, as torch divides
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty),
                 mask=cols < N_COLS)
    else:
        amax = row_absmax(x_ptr, row, stride_x, N_COLS, BLOCK)
        scale = tl.maximum(tl.div_rn(amax, FP8_MAX_C), min_scale)
        tl.store(s_ptr + row, scale)
        for start in range(0, N_COLS, BLOCK):
            c = start + cols
            x = _load_row(x_ptr, row, stride_x, c, N_COLS)
            q = round_e4m3(tl.div_rn(x, scale))
            tl.store(q_ptr + row * stride_q + c, q.to(q_ptr.dtype.element_ty),
                     mask=c < N_COLS)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]`` (last dim contiguous) -> ``(q [T, C] e4m3, scale [T, 1] fp32)``."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    t, c = x.shape
    q = torch.empty((t, c), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, s
    # One pass over a row up to 16,384 columns (32 values a thread at 16 warps): each
    # pass is a dependent round trip to memory, and at batch 1 this one program is the
    # whole kernel (down_proj's 14,336 inputs in 4,096-column passes took 6 us on an
    # H200, the other projections' 4,096 columns 2 us).  Same values either way.
    block = min(16384, triton.next_power_of_2(c))
    _per_token_quant_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), FP8_MIN_SCALE,
                                  N_COLS=c, FP8_MAX_C=FP8_MAX, BLOCK=block,
                                  num_warps=16 if block >= 8192 else 8 if block >= 2048
                                  else 4, **pdl_launch_args(x.device))
    return q, s
