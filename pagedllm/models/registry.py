"""Map a Hugging Face config's ``architectures`` to our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

# Configs built from GGUF by transformers carry no `architectures`; fall back on model_type.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for ``hf_config``; ``ValueError`` naming ``architectures`` otherwise."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if not archs:
        fallback = _MODEL_TYPES.get(getattr(hf_config, "model_type", None) or "")
        if fallback:
            return MODEL_REGISTRY[fallback]
    raise ValueError(
        f"architectures: {archs or '(none)'} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}")
