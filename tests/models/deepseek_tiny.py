"""Tiny random DeepSeek-V2 / V3 checkpoints built offline by transformers (no downloads).

Every config: hidden 64, 4 heads, ``kv_lora_rank`` 32, ``qk_nope_head_dim`` 16,
``qk_rope_head_dim`` 8, ``v_head_dim`` 12 (!= nope, so a mixed-up split shows), a
320-token vocabulary.  Dense (``first_k_dense_replace`` = layers) until the DeepSeekMoE
block exists (``models/deepseek_moe.py``); with it, the last layer is MoE.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import transformers

from tests.models.tiny_models import randomize

VOCAB = 320
LAYERS = 3


def has_moe() -> bool:
    """Whether the DeepSeekMoE block has landed (then the last layer is MoE)."""
    return importlib.util.find_spec("pagedllm.models.deepseek_moe") is not None


def _common() -> dict[str, Any]:
    dense = LAYERS - 1 if has_moe() else LAYERS
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                first_k_dense_replace=dense, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1)


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
         "beta_fast": 32, "beta_slow": 1}

CONFIGS: dict[str, Callable[[], Any]] = {
    # V2-Lite: no query LoRA (q_proj), interleaved RoPE.
    "v2_lite": lambda: transformers.DeepseekV2Config(
        **_common(), q_lora_rank=None, topk_method="greedy",
        architectures=["DeepseekV2ForCausalLM"]),
    # V2 with query LoRA and YaRN (mscale / mscale_all_dim; prompts run past the
    # original context of 64).
    "v2_yarn": lambda: transformers.DeepseekV2Config(
        **_common(), q_lora_rank=24, rope_parameters=dict(_YARN), topk_method="greedy",
        architectures=["DeepseekV2ForCausalLM"]),
    # V3: query LoRA, interleaved RoPE, grouped sigmoid routing with correction bias.
    "v3": lambda: transformers.DeepseekV3Config(
        **_common(), q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, architectures=["DeepseekV3ForCausalLM"]),
    # V3 with rope_interleave off (neox halves) and YaRN.
    "v3_neox_yarn": lambda: transformers.DeepseekV3Config(
        **_common(), q_lora_rank=24, rope_interleave=False, rope_parameters=dict(_YARN),
        n_group=2, topk_group=1, norm_topk_prob=True,
        architectures=["DeepseekV3ForCausalLM"]),
}
HF_CLASSES: dict[str, Any] = {
    "v2_lite": transformers.DeepseekV2ForCausalLM,
    "v2_yarn": transformers.DeepseekV2ForCausalLM,
    "v3": transformers.DeepseekV3ForCausalLM,
    "v3_neox_yarn": transformers.DeepseekV3ForCausalLM,
}


def build(name: str, path: str) -> torch.nn.Module:
    """Save a random ``name`` checkpoint to ``path``; return the HF model (fp32, eval)."""
    torch.manual_seed(0)
    hf = HF_CLASSES[name](CONFIGS[name]()).eval()
    randomize(hf, seed=len(name))
    with torch.no_grad():  # a correction bias that changes which experts win
        for mod_name, buf in hf.named_buffers():
            if mod_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(3))
                          * 0.1)
    hf.save_pretrained(path, safe_serialization=True)
    return hf
