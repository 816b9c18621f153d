"""Rotary position embedding (RoPE), neox / Hugging Face layout.

Each head vector's first ``rotary_dim`` features are split in halves ``(x1, x2)`` and
rotated by position-dependent angles: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` -- HF's
``q * cos + rotate_half(q) * sin`` with the same operation order, so results match bit
for bit in float32; the rest of the head (``partial_rotary_factor < 1``, Phi-4-mini)
passes through.  (llama.cpp's interleaved layout is undone at load time by un-permuting
the GGUF q/k weights.)

cos/sin are precomputed in float32 for every position up to ``max_position_embeddings``
and gathered by ``positions`` each step.  Scalings, as transformers computes them:

* ``default``, ``linear``, ``llama3`` (Llama 3.1+);
* ``yarn`` (Qwen, DeepSeek): blended inv_freq, cos/sin scaled by its attention factor;
* ``longrope`` / ``su`` (Phi-3, Phi-4): ``short_factor`` for positions below
  ``original_max_position_embeddings``, ``long_factor`` from there on, cos/sin scaled.
  HF switches the whole sequence to ``long_factor`` once it is longer than the original
  context (so HF's own cached and uncached runs differ there); a per-position table is
  the cache-consistent choice and equals HF for every sequence within the original
  context;
* ``dynamic`` (dynamic NTK): HF's frequencies change only for sequences longer than
  ``max_position_embeddings``, which the engine never runs (max_model_len is capped by
  it), so inside the table it is the default rotary exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.rope import RopeInputs


def rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """``{"rope_theta": float, "rope_type": str, ...scaling keys}`` from either
    transformers-5 ``rope_parameters`` or transformers-4 ``rope_theta`` + ``rope_scaling``.
    ``layer_type`` picks one kind's entry of a per-layer-type dict (Gemma 3:
    ``sliding_attention`` / ``full_attention``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and layer_type in params:
        params = params[layer_type]
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and not isinstance(params, dict):
        out.update(scaling)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    if out["rope_type"] == "su":  # Phi-3's early name for longrope
        out["rope_type"] = "longrope"
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in out and getattr(hf_config, key, None) is not None:
            out[key] = getattr(hf_config, key)
    return out


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """Features rotated per head: ``int(head_dim * partial_rotary_factor)`` (as HF)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, params: dict[str, Any],
          max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, ramp between."""
    base = float(params["rope_theta"])
    old_ctx = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / old_ctx
    attn = params.get("attention_factor")
    if attn is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    half = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((half - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    interp = 1.0 / (factor * pos_freqs)
    return interp * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation, float(attn)


def _longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    old_ctx = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / old_ctx
    attn = params.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    return float(attn)


def _inv_freq(head_dim: int, params: dict[str, Any],
              max_position: int = 0) -> tuple[torch.Tensor, float]:
    """Per-pair angular frequencies over ``head_dim`` rotated features and the factor
    cos/sin are scaled by, computed exactly as transformers does.  (``longrope`` is built
    by ``RotaryEmbedding`` from two of these.)"""
    base = float(params["rope_theta"])
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(
        torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponent)
    kind = params["rope_type"]
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, params, max_position)
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
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, "
                     "llama3, yarn, longrope, dynamic)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position; shared by all layers of a model.

    Per step the model calls ``inputs(positions)`` once and every layer then rotates
    through the returned ``RopeInputs`` -- the gather and dtype cast are not repeated
    per layer.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        rot = rotary_dim_of(head_dim, params)
        if rot % 2:
            raise ValueError(f"rotary dim must be even, got {rot}")
        self.head_dim = head_dim
        self.rotary_dim = rot
        # Built in float32 on the CPU (as HF does) whatever the model dtype and the
        # ambient device, then moved; ``outer`` is the same single multiply per entry as
        # HF's ``inv_freq @ positions``.
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        if params["rope_type"] == "longrope":
            scale = _longrope_attention_factor(params, max_position)
            old_ctx = int(params["original_max_position_embeddings"])
            short = torch.tensor(params["short_factor"], dtype=torch.float32, device="cpu")
            long = torch.tensor(params["long_factor"], dtype=torch.float32, device="cpu")
            # HF's inv_freq = 1 / (ext_factors * base ** (2i / rot)), per factor set.
            exponent = torch.arange(0, rot, 2, dtype=torch.int64, device="cpu").to(
                torch.float32) / rot
            pw = float(params["rope_theta"]) ** exponent
            freqs = torch.cat((torch.outer(t[:old_ctx], 1.0 / (short * pw)),
                               torch.outer(t[old_ctx:], 1.0 / (long * pw))))
        else:
            inv_freq, scale = _inv_freq(rot, params, max_position)
            freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        cache = torch.cat((cos, sin), dim=-1)  # [max_pos, rotary_dim]
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
