"""Qwen2: Llama's graph with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_attention(config: Any, backend: AttentionBackend,
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> LlamaAttention:
        return LlamaAttention(config, backend, qkv_bias=True, o_bias=False,
                              quant_config=quant_config, prefix=prefix)
