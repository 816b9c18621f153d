"""RMSNorm, optionally fused with the residual add (vLLM's calling convention)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.cpu import rms_norm as cpu_rms_norm


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like Hugging Face.

    ``forward(x)`` returns the normed ``x``.  ``forward(x, residual)`` first forms
    ``x + residual`` (the decoder's skip connection, added in the activation dtype as HF
    does) and returns ``(normed, x + residual)`` -- the new residual stream -- so a
    decoder layer never materialises the add separately.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # Multi-LoRA: the ``LoRALinear`` of the projection reading this norm's output
        # (set by the LoRA manager); at batch 1 its shrink runs in the norm's launch.
        self.lora_next: Any = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; same math as below up to float rounding.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half types: upcast for the statistics, cast back *before* the weight multiply,
        # exactly as transformers' LlamaRMSNorm does (bit-for-bit parity matters for greedy
        # decoding).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.lora_next is not None:  # batch 1: + the next projection's LoRA shrink
            fused = self.lora_next.norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if x.is_cuda and x.dtype != torch.float32:
            # One fused Triton kernel (add + statistics + scale) with HF's rounding order.
            from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_rms_norm.applies(x, self.weight, residual):  # float32 CPU rows: one C call
            return cpu_rms_norm.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and
    cast back once at the end (transformers' ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``; the
    checkpoint stores ``weight`` zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
