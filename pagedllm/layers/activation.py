"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu import silu_mul as cpu_silu_mul


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d`` (the fused gate_up
    projection's output: gate first, then up, as ``MergedColumnParallelLinear`` stores
    them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm.kernels.activation import silu_and_mul

            return silu_and_mul(x)  # one Triton kernel instead of three torch ops
        if cpu_silu_mul.applies(x):  # float32 CPU rows: one C call
            return cpu_silu_mul.silu_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
