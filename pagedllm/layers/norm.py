"""RMSNorm, optionally fused with the residual add (vLLM's calling convention)."""

from __future__ import annotations

from collections.abc import Iterator
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
        # The projection (``LinearBase``) reading this norm's output, where its
        # quantisation method fuses work into the norm (``link_norms``).
        self.linear_next: Any = None

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
        if self.linear_next is not None:  # + the next projection's input quantisation
            lin = self.linear_next
            fused = lin.quant_method.rms_norm_input(lin, x, residual, self.weight, self.eps)
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


# A decoder layer's norms and the projections that read their outputs.
_NORM_READERS = (("input_layernorm", "self_attn", "qkv_proj"),
                 ("post_attention_layernorm", "mlp", "gate_up_proj"))


def norm_readers(model: nn.Module) -> Iterator[tuple[RMSNorm, nn.Module]]:
    """Each decoder layer's ``RMSNorm`` with the projection that reads its output
    (``input_layernorm`` -> ``self_attn.qkv_proj``, ``post_attention_layernorm`` ->
    ``mlp.gate_up_proj``), where both exist."""
    for m in model.modules():
        for norm, parent, proj in _NORM_READERS:
            n = getattr(m, norm, None)
            lin = getattr(getattr(m, parent, None), proj, None)
            if isinstance(n, RMSNorm) and lin is not None:
                yield n, lin


def link_norms(model: nn.Module) -> None:
    """Link each decoder-layer norm to the projection reading its output
    (``RMSNorm.linear_next``) where that projection's quantisation method fuses work
    into the norm (``LinearMethodBase.rms_norm_input``: FP8's per-token quantiser).
    Run once after loading."""
    from pagedllm.layers.quantization.base import LinearMethodBase

    for norm, lin in norm_readers(model):
        method = getattr(lin, "quant_method", None)
        if method is not None and \
                type(method).rms_norm_input is not LinearMethodBase.rms_norm_input:
            norm.linear_next = lin


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and
    cast back once at the end (transformers' ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``; the
    checkpoint stores ``weight`` zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype != torch.float32:  # one Triton launch, same roundings
            from pagedllm.kernels.norm import gemma_norm

            return gemma_norm(x, self.weight, self.eps)  # type: ignore[return-value]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Gemma's post-norm skip connection ``residual + self(x)``: on CUDA in half types
        one launch (``kernels/norm.gemma_norm``), else these torch ops."""
        if x.is_cuda and x.dtype != torch.float32:
            from pagedllm.kernels.norm import gemma_norm

            return gemma_norm(x, self.weight, self.eps, residual)  # type: ignore[return-value]
        return residual + self(x)

    def add_then(self, x: torch.Tensor, residual: torch.Tensor,
                 then: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(then(h), h)`` with ``h = residual + self(x)``: the next norm read from the
        same registers (one launch on CUDA in half types)."""
        if x.is_cuda and x.dtype != torch.float32:
            from pagedllm.kernels.norm import gemma_norm

            return gemma_norm(x, self.weight, self.eps, residual,  # type: ignore[return-value]
                              then.weight)
        h = residual + self(x)
        return then(h), h
