"""Multi-head latent attention (DeepSeek-V2/V3): projections, decoupled RoPE, the latent
KV write and attention over the paged latent cache (``attention/mla_torch.py``).

```
 x ─► q_proj                        (V2-Lite: q_lora_rank null)       ─┐
  └─► q_a_proj ─► q_a_layernorm ─► q_b_proj  (V2/V3)                  ─┴─► q [H, Dn | R]
  └─► kv_a_proj_with_mqa ─► [ c_kv (L) ─► kv_a_layernorm | k_pe (R) ]
      q_pe, k_pe ─► RoPE;   cache ◄─ [c_kv | k_pe]   (one entry per token, all heads)
      attention (absorbed or expanded, per the backend's rule) ─► [H, Dv] ─► o_proj
```

RoPE layout, as transformers runs each model: DeepSeek-V2, and V3 with
``rope_interleave`` (its default), rotate interleaved pairs ``(x0, x1), (x2, x3), ...``;
V3 without it rotates halves (neox).  Only ``q_pe . k_pe`` is ever used, so we store the
rotated pairs de-interleaved (evens then odds: V3's own output layout): the dot product
is the same sum.  The softmax scale is ``qk_head_dim ** -0.5`` times, under YaRN with
``mscale_all_dim``, ``mscale(factor, mscale_all_dim) ** 2`` (transformers'
``yarn_apply_mscale``); the rotary tables carry YaRN's own attention factor.

Attention reads ``kv_b_proj``'s per-head blocks (``W_UK``, ``W_UV``) as a dense weight
(``kv_b_weight``): the parameter itself when unquantised; under a quantisation method
(block-FP8 DeepSeek-V3 checkpoints, ``--quantization fp8``) the layer applied once to the
identity -- the method's own dequantisation, to rounding -- cached until its parameters
change.  The norms inside attention use eps 1e-6, as transformers builds them (not
``rms_norm_eps``).

An fp8 latent cache (``kv_cache_dtype="fp8"``) stores ``[c_kv | k_pe] / k_scale``; the
layer's ``k_scale`` is one host float for the whole entry (there is no separate value
scale: the latent is both), set like a GQA layer's (``layers/attention.py``): 1.0, the
checkpoint's ``self_attn.k_scale`` (``models/loader.take_kv_scales``), or, under
``--calculate-kv-scales``, ``amax(|[c_kv | k_pe]|) / 200`` (``layers/kv_scales.py``'s
key constant) over the first real batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_torch import MLA_MODES, MLADims, MLAMode, MLATorchBackend
from pagedllm.attention.rope import RopeInputs, apply_rotary
from pagedllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.rotary import rope_parameters


def mla_softmax_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, with DeepSeek's YaRN ``mscale_all_dim`` correction."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    params = rope_parameters(config)
    mscale_all = params.get("mscale_all_dim")
    factor = float(params.get("factor") or 1.0)
    if params["rope_type"] != "default" and mscale_all and factor > 1:
        m = 0.1 * float(mscale_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def rope_interleaved(config: Any) -> bool:
    """Whether the model rotates interleaved pairs (V2 always; V3 per ``rope_interleave``)."""
    if getattr(config, "model_type", "") == "deepseek_v3":
        return bool(getattr(config, "rope_interleave", True))
    return True


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE of ``x [T, H, R]`` (``cos``/``sin`` ``[T, 1, R/2]``), output
    de-interleaved: ``cat(x0 cos - x1 sin, x1 cos + x0 sin)`` over pairs ``(x0, x1)``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """One DeepSeek attention layer over its latent KV cache.

    ``kv_cache`` (``[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``)
    is bound after the KV memory is planned (the model's ``bind_kv_caches``).  ``mode``
    (``attention/mla_torch.py``): "auto" (decodes absorbed, longer queries expanded),
    or "absorbed" / "expanded" for every request.  ``forward`` has the signature of
    ``LlamaAttention.forward``, so the Llama decoder layer and stack carry it."""

    def __init__(self, config: Any, backend: MLATorchBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        total_heads = int(config.num_attention_heads)
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.nope, self.rope_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        qk_head = self.nope + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head, False,
                                               quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
            heads = self.q_proj.out_per_partition // qk_head
        else:
            self.q_a_proj = ReplicatedLinear(hidden, int(self.q_lora_rank), bias,
                                             quant_config=quant_config,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), 1e-6)
            self.q_b_proj = ColumnParallelLinear(int(self.q_lora_rank), total_heads * qk_head,
                                                 False, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
            heads = self.q_b_proj.out_per_partition // qk_head
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.rope_dim, bias, quant_config=quant_config,
            prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_heads * (self.nope + self.v_head_dim),
                                              False, quant_config=quant_config,
                                              prefix=f"{prefix}.kv_b_proj")
        self._kv_b_dense: torch.Tensor | None = None  # kv_b_weight's cache (quantised)
        self._kv_b_key: tuple[tuple[int, int], ...] = ()
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.num_heads = heads  # this rank's
        self.dims = MLADims(heads, self.kv_lora_rank, self.nope, self.rope_dim,
                            self.v_head_dim)
        self.scale = mla_softmax_scale(config)
        self.interleaved = rope_interleaved(config)
        self.backend = backend
        self.mode: MLAMode = "auto"
        self.kv_cache = torch.empty(0)
        # The fp8 latent cache's scale (module doc); armed for one forward by the model
        # runner under --calculate-kv-scales (layers/kv_scales.py).
        self.k_scale = 1.0
        self.calculate_kv_scales = False

    def set_mode(self, mode: str) -> None:
        """Force the absorbed or expanded form for every request, or "auto"."""
        if mode not in MLA_MODES:
            raise ValueError(f"mla mode must be one of {MLA_MODES}, got {mode!r}")
        self.mode = mode  # type: ignore[assignment]

    def kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``kv_b_proj``'s (this rank's) weight ``[H * (Dn + Dv), L]``, dense: see the
        module docstring.  Identity rows are one-hot, which activation-quantising methods
        represent exactly too."""
        w = self.kv_b_proj.unquantized_weight
        if w is not None:
            return w
        key = tuple((id(p), p._version) for p in self.kv_b_proj.parameters())
        if self._kv_b_dense is None or key != self._kv_b_key:
            dev = next(self.kv_b_proj.parameters()).device
            eye = torch.eye(self.kv_lora_rank, dtype=dtype, device=dev)
            self._kv_b_dense = self.kv_b_proj(eye).t().contiguous()
            self._kv_b_key = key
        return self._kv_b_dense

    def _calc_k_scale(self, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      meta: AttentionMetadata) -> None:
        """Set ``k_scale`` from this batch's real entries (as the cache stores them), once."""
        from pagedllm.layers.kv_scales import scales_from_amax

        n = meta.num_actual_tokens
        entries = torch.cat((c_kv[:n], k_pe[:n]), dim=-1)
        self.k_scale = scales_from_amax(entries, entries)[0]  # (its value scale: unused)
        self.calculate_kv_scales = False

    def _rotate(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        cos_sin = rope.cos_sin_cache.index_select(0, rope.positions).to(rope.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return rotate_pairs(x, cos, sin) if self.interleaved else apply_rotary(x, cos, sin)

    def _rope_norm_write_torch(self, q: torch.Tensor, ckv: torch.Tensor, rope: RopeInputs,
                               meta: AttentionMetadata) -> torch.Tensor:
        """The prologue in torch ops (the CPU's path, and the first batch under
        ``--calculate-kv-scales``): rotate q_pe and k_pe, normalise c_kv, write the
        latent entry -> the rotated ``q_pe [T, H, R]``."""
        c_kv = self.kv_a_layernorm(ckv[:, :self.kv_lora_rank].contiguous())
        k_pe = ckv[:, self.kv_lora_rank:].unsqueeze(1)
        # q_pe and k_pe share the step's cos/sin: rotate them in one pass.
        pe = self._rotate(torch.cat((q[..., self.nope:], k_pe), dim=1), rope)
        q_pe, k_pe = pe[:, :self.num_heads], pe[:, self.num_heads]
        if self.calculate_kv_scales:
            self._calc_k_scale(c_kv, k_pe, meta)
        self.backend.write(c_kv, k_pe, self.kv_cache, meta,  # type: ignore[arg-type]
                           self.k_scale)
        return q_pe

    def forward(self, rope: RopeInputs, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (or one row per index of ``rows``, in
        that order).  Writes every real token's latent entry into ``kv_cache``."""
        if self.kv_cache.numel() == 0:
            raise RuntimeError("MultiHeadLatentAttention.kv_cache is not bound; call "
                               "model.bind_kv_caches(kv_caches) before forward")
        if meta.kv_ready is not None:  # blocks of this step loaded from the host tier
            meta.kv_ready(self.kv_cache)
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope = q[..., :self.nope]
        ckv = self.kv_a_proj_with_mqa(x)
        q_pe = None
        if not self.calculate_kv_scales:  # one launch where the backend's kernel runs
            q_pe = self.backend.rope_norm_write(q, ckv, self.kv_a_layernorm.weight,
                                                self.kv_a_layernorm.eps, rope,
                                                self.interleaved, self.kv_cache, meta,
                                                self.nope, self.k_scale)
        if q_pe is None:
            q_pe = self._rope_norm_write_torch(q, ckv, rope, meta)
        out = self.backend.forward(q_nope, q_pe, self.kv_cache, meta, self.scale,
                                   self.kv_b_weight(x.dtype), self.dims, self.mode,
                                   self.k_scale)
        out = out.reshape(t, self.num_heads * self.v_head_dim)
        if rows is not None:
            out = out.index_select(0, rows)
        return self.o_proj(out)
