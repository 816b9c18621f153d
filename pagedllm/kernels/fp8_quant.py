"""Per-token e4m3 quantisation of activations for the FP8 GEMM, in one launch.

For each row ``x[t, :]``: ``scale[t] = max(amax(|x[t]|) / 448, min_scale)`` and
``q[t, :] = clamp(x[t] / scale[t], -448, 448)`` rounded to e4m3 -- exactly
``layers/quantization/fp8.quantize_fp8_rows`` (the oracle).  One program per row
reads the row twice (amax, then quantise); the second read hits L2 for the activation
widths of these models (<= 28 KB per row), so the kernel costs about one pass over
``x`` where the torch version takes five launches.  The grid is the row count (a host
int): CUDA-graph safe, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, min_scale,
                            FP8_MAX_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX_C, min_scale)
    tl.store(s_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=c < n_cols)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]`` (last dim contiguous) -> ``(q [T, C] e4m3, scale [T, 1] fp32)``."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    t, c = x.shape
    q = torch.empty((t, c), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, s
    block = min(4096, triton.next_power_of_2(c))
    _per_token_quant_kernel[(t,)](x, q, s, c, x.stride(0), q.stride(0), _MIN_SCALE,
                                  FP8_MAX_C=FP8_MAX, BLOCK=block,
                                  num_warps=8 if block >= 2048 else 4)
    return q, s
