"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d`` (the fused gate_up
    projection's output: gate first, then up, as ``MergedColumnParallelLinear`` stores
    them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm.kernels.activation import silu_and_mul

            return silu_and_mul(x)  # one Triton kernel instead of three torch ops
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
