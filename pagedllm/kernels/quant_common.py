"""Quantisation constants and reference quantisers shared by the kernels and the
quantised layers above them (``layers/quantization/fp8.py``, ``fp8_moe.py``,
``int8_w8a8.py``): they sit here, below both, so the kernels never import a layer.

```
 fp8 e4m3  x [R, C] --amax / 448 per row (or per tensor)-->  q e4m3, scale fp32
 int8      x [T, K] --amax / 127.5 per token-->               q int8 [-128, 127], scale fp32
```
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale: an all-zero row quantises to zeros instead of dividing by zero.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token / per-output-channel) e4m3 quantisation of a 2-D tensor:
    ``(q [R, C] e4m3, scale [R, 1] fp32)`` with ``q * scale ~= x``; values saturate at
    +-448 times the scale, so nothing overflows to NaN."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 quantisation: ``(q, scale [] fp32)``."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


_INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: compressed-tensors' symmetric int8 range


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(x_q int8 [T, K], x_scale fp32 [T, 1])``, the library's dynamic
    per-token symmetric quantisation (``int8_w8a8.py``'s module doc), computed in ``x``'s dtype."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / _INT8_HALF_RANGE
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    q = torch.round(torch.clamp(x / scale, -128, 127)).to(torch.int8)
    return q, scale.float()
