"""Mixtral: Llama's attention (GQA, no bias) with every MLP a sparse MoE block of
``num_local_experts`` SwiGLU experts, top-``num_experts_per_tok`` routing, always
renormalised.  Checkpoint names: ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    expert_names = ("w1", "w2", "w3")

    @staticmethod
    def num_experts_of(config: Any) -> int:
        return int(config.num_local_experts)

    @staticmethod
    def make_mlp(config: Any, layer: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, renormalize=True, quant_config=quant_config,
            prefix=prefix.removesuffix(".mlp") + ".block_sparse_moe")

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        return super().weight_target(name.replace(".block_sparse_moe.", ".mlp."))
