"""Tiny random checkpoints of the architectures beyond Llama/Qwen2/Qwen3, built offline by
transformers from a config and saved as safetensors (no downloads).

Every config is 2 layers, hidden 64, a 320-token vocabulary; each exercises its family's
distinctive parts (noted per entry).  ``build(arch, path)`` returns the HF model (fp32,
eval, every weight randomised so a weight loaded into the wrong place changes logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

VOCAB = 320
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, max_position_embeddings=256,
                              rms_norm_eps=1e-5, tie_word_embeddings=False)

CONFIGS: dict[str, Callable[[], Any]] = {
    # 4 experts, top-2, always renormalised; GQA 2:1.
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
    # Shared expert + sigmoid gate, top-2 without renormalisation, q/k/v bias; layer 1
    # is a dense MLP (mlp_only_layers).
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
        architectures=["Qwen2MoeForCausalLM"]),
    # q/k norm, top-3 of 8 renormalised, head_dim 32 != 64 / 4.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]),
    # Fused qkv / gate_up checkpoint tensors, LongRoPE with partial rotary (12 of 16
    # features), prompts within the original context (see layers/rotary.py).
    "phi3": lambda: transformers.Phi3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]},
        architectures=["Phi3ForCausalLM"]),
    # YaRN scaling (original context 64 < prompt positions), q/k/v bias.
    "qwen2_yarn": lambda: transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64},
        architectures=["Qwen2ForCausalLM"]),
    # Sliding window 16 on every layer (prompts run past it).
    "mistral_sw": lambda: transformers.MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
        architectures=["MistralForCausalLM"]),
    # Local (window 16) / global layers, attention and final logit soft-caps small enough
    # to bite, query_pre_attn_scalar != head_dim, tied embeddings.
    "gemma2": lambda: transformers.Gemma2Config(
        **{**COMMON, "tie_word_embeddings": True}, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        architectures=["Gemma2ForCausalLM"]),
    # Local (window 16, base 10k) then global (base 1M, linear x2) layers, q/k norm.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "tie_word_embeddings": True}, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                            "factor": 2.0}},
        architectures=["Gemma3ForCausalLM"]),
}
HF_CLASSES: dict[str, Any] = {
    "mixtral": transformers.MixtralForCausalLM,
    "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "qwen2_yarn": transformers.Qwen2ForCausalLM,
    "mistral_sw": transformers.MistralForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF zero-inits biases and one-inits norms; randomise everything."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def build(arch: str, path: str) -> torch.nn.Module:
    """Save a random ``arch`` checkpoint to ``path``; return the HF model."""
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](CONFIGS[arch]()).eval()
    randomize(hf, seed=len(arch))
    hf.save_pretrained(path, safe_serialization=True)
    return hf
