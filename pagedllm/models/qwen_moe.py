"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention with sparse MoE MLPs.

A layer is sparse unless it is in ``mlp_only_layers`` or ``(layer + 1)`` is not a
multiple of ``decoder_sparse_step`` (then a dense MLP of ``intermediate_size``).  Routing
is top-``num_experts_per_tok`` of ``num_experts``, renormalised per ``norm_topk_prob``;
Qwen2-MoE adds a gated shared expert (``shared_expert_intermediate_size``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, make_llama_mlp
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM


def _is_sparse(config: Any, layer: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer + 1) % step == 0)


def _make_qwen_moe_mlp(config: Any, layer: int, quant_config: QuantizationConfig | None,
                       prefix: str) -> nn.Module:
    if not _is_sparse(config, layer):
        return make_llama_mlp(config, layer, quant_config, prefix)
    return SparseMoeBlock(
        config.hidden_size, config.num_experts, config.num_experts_per_tok,
        config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
        shared_intermediate=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        quant_config=quant_config, prefix=prefix)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    make_mlp = staticmethod(_make_qwen_moe_mlp)

    @staticmethod
    def make_attention(config: Any, backend: AttentionBackend,
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> LlamaAttention:
        return Qwen2ForCausalLM.make_attention(config, backend, quant_config, prefix)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    make_mlp = staticmethod(_make_qwen_moe_mlp)

    @staticmethod
    def make_attention(config: Any, backend: AttentionBackend,
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> LlamaAttention:
        return Qwen3ForCausalLM.make_attention(config, backend, quant_config, prefix)
