"""Qwen3: Llama's graph with per-head RMSNorm on q and k before RoPE (``q_norm``/``k_norm``,
weights of size ``head_dim``) and, by default, no attention bias.  ``head_dim`` is explicit
in the config and need not equal ``hidden_size / num_heads``."""

from __future__ import annotations

from typing import Any

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_attention(config: Any, backend: AttentionBackend,
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> LlamaAttention:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, backend, qkv_bias=bias, o_bias=bias, qk_norm=True,
                              quant_config=quant_config, prefix=prefix)
