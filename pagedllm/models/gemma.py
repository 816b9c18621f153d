"""Gemma 2 and Gemma 3 (text): local/global attention layers in one decoder.

```
 ids -> embed * sqrt(hidden) -> [ h + post_attn_norm(attn(input_norm(h)))
                                  h + post_ffw_norm(mlp(pre_ffw_norm(h))) ] x L
     -> norm -> lm_head -> (final soft-cap)
```

* Layers alternate by ``layer_types``: ``sliding_attention`` layers see the last
  ``sliding_window`` keys, ``full_attention`` layers everything (Gemma 2: 1:1, Gemma 3:
  5 local : 1 global).
* Norms are ``GemmaRMSNorm`` (``1 + weight``, float32); the MLP is GELU-tanh gated;
  attention is scaled by ``query_pre_attn_scalar ** -0.5``.
* Gemma 2 soft-caps attention logits (``attn_logit_softcapping``) and final logits
  (``final_logit_softcapping``): ``c * tanh(x / c)``.
* Gemma 3 adds per-head q/k ``GemmaRMSNorm`` and a RoPE per layer kind (local base 10k,
  global base 1M with optional linear scaling: ``rope_parameters[layer_type]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kinds import AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs
from pagedllm.distributed.parallel_state import current_parallel_state
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    gemv_applies,
)
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, attention_kind, head_dim_of


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate] * 2, False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate, hidden, False,
                                           quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gemv_applies(gate_up, self.down_proj) and self.down_proj.lora is None:
            # Batch-1 decode: the activation runs inside down_proj's GEMV.
            return self.down_proj.forward_gated(gate_up, gelu_tanh=True)
        if gate_up.is_cuda and gate_up.dtype != torch.float32:  # one launch, same roundings
            from pagedllm.kernels.activation import gelu_tanh_and_mul

            return self.down_proj(gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, attention kind and (Gemma 3) q/k norms."""

    def __init__(self, config: Any, backend: AttentionBackend, layer: int, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, backend, qkv_bias=bool(config.attention_bias),
                         o_bias=bool(config.attention_bias), qk_norm=qk_norm,
                         quant_config=quant_config, prefix=prefix)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)  # type: ignore
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)  # type: ignore
        cap = getattr(config, "attn_logit_softcapping", None)
        kind = AttentionKind(attention_kind(config, layer).sliding_window, cap or None)
        self.attn = Attention(self.num_heads, self.head_dim,
                              float(config.query_pre_attn_scalar) ** -0.5,
                              self.num_kv_heads, backend, kind)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, layer: int, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, backend, layer, qk_norm, quant_config,
                                        f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, quant_config,
                            f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.is_sliding = self.self_attn.attn.kind.sliding_window is not None

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, normed: torch.Tensor,
                meta: AttentionMetadata, next_norm: GemmaRMSNorm,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed = input_layernorm(hidden)`` (the previous layer's launch made it);
        returns ``(next_norm(h), h)`` for this layer's output ``h``, where ``next_norm``
        reads it: the next layer's input norm, or the model's final norm."""
        attn = self.self_attn(rope, normed, meta, rows)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        # post-attention norm + skip + pre-feed-forward norm, then post-norm + skip + the
        # next norm: two launches on the GPU (a decode step is otherwise ~40 tiny kernels
        # a layer).
        normed, hidden = self.post_attention_layernorm.add_then(
            attn, hidden, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_then(self.mlp(normed), hidden, next_norm)


class GemmaModel(nn.Module):
    """Gemma's decoder stack, always one pipeline stage (every layer, first and last)."""

    def __init__(self, config: Any, backend: AttentionBackend, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str = "model") -> None:
        super().__init__()
        if current_parallel_state().pp.world_size > 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported for Gemma 2/3 "
                             "(use tensor_parallel_size)")
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.is_first = self.is_last = True
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.normalizer = float(config.hidden_size) ** 0.5
        hd, max_pos = head_dim_of(config), config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(hd, max_pos, rope_parameters(config))
        # Gemma 3: the local layers' own base (rope_parameters["sliding_attention"]).
        local = rope_parameters(config, "sliding_attention")
        self.rotary_emb_local = RotaryEmbedding(hd, max_pos, local) \
            if local != rope_parameters(config) else None
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, backend, i, qk_norm, quant_config,
                              f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' scaled embeddings (transformers' ``Gemma3TextScaledWordEmbedding``:
        times the normaliser cast to the activation dtype)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.normalizer, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_only: bool = False,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor:
        # ``inputs_embeds``: a step with images (models/gemma3_mm.py), already scaled
        # rows of ``embed`` with the image rows written over them (those are not scaled).
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.inputs(positions, hidden.dtype)
        rope_local = self.rotary_emb_local.inputs(positions, hidden.dtype) \
            if self.rotary_emb_local is not None else rope
        rows = meta.query_start_loc[1:] - 1 if last_only and meta.max_query_len > 1 \
            else None
        last = len(self.layers) - 1
        normed = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i < last else self.norm
            normed, hidden = layer(rope_local if layer.is_sliding else rope, hidden, normed,
                                   meta, nxt, rows if i == last else None)
        return normed


class Gemma2ForCausalLM(LlamaForCausalLM):
    """The model-runner interface of ``LlamaForCausalLM`` (its weight loading and KV
    binding are reused: same parameter names and fused q/k/v, gate/up)."""

    qk_norm = False

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = GemmaModel(hf_config, backend, self.qk_norm, quant_config)  # type: ignore
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None) or None

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings, as ``inputs_embeds`` takes them."""
        return self.model.embed(input_ids)  # type: ignore[operator]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
