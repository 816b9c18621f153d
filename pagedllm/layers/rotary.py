"""Rotary position embedding (RoPE), neox / Hugging Face layout.

Each head vector is split in halves ``(x1, x2)`` and rotated by position-dependent
angles: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` -- HF's ``q * cos + rotate_half(q) * sin``
with the same operation order, so results match bit for bit in float32.  (llama.cpp's
interleaved layout is undone at load time by un-permuting the GGUF q/k weights.)

cos/sin are precomputed in float32 for every position up to ``max_position_embeddings``
and gathered by ``positions`` each step; supported scalings: ``default``, ``linear`` and
``llama3`` (Llama 3.1+).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.rope import RopeInputs


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """``{"rope_theta": float, "rope_type": str, ...scaling keys}`` from either
    transformers-5 ``rope_parameters`` or transformers-4 ``rope_theta`` + ``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form; we only do full attention
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and not isinstance(params, dict):
        out.update(scaling)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair angular frequencies, computed exactly as transformers does."""
    base = float(params["rope_theta"])
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(
        torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponent)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the middle band blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, "
                     "llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position; shared by all layers of a model.

    Per step the model calls ``inputs(positions)`` once and every layer then rotates
    through the returned ``RopeInputs`` -- the gather and dtype cast are not repeated
    per layer.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        # Built in float32 on the CPU (as HF does) whatever the model dtype and the
        # ambient device, then moved; ``outer`` is the same single multiply per entry as
        # HF's ``inv_freq @ positions``.
        inv_freq = _inv_freq(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, head_dim]
        target = torch.empty(0).device  # the ambient default device (model build context)
        self.register_buffer("cos_sin_cache", cache.to(target), persistent=False)

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """This step's rotary inputs for activations of ``dtype`` (HF casts cos/sin to
        the activation dtype before multiplying, and so do we)."""
        return RopeInputs(positions, self.cos_sin_cache, dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convenience: ``q [T, Hq*D]``, ``k [T, Hk*D]`` -> rotated ``(q, k)``, same shapes."""
        rope = self.inputs(positions, q.dtype)
        t = q.shape[0]
        return (rope.rotate(q.view(t, -1, self.head_dim)).view(t, -1),
                rope.rotate(k.view(t, -1, self.head_dim)).view(t, -1))
