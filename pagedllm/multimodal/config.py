"""Multimodal settings and the composite (vision + text) model config.

A vision-language checkpoint's config (``LlavaConfig``) keeps the decoder's numbers in
``text_config``; the engine (KV cache size, memory plan, rotary, LoRA shapes) reads them
from the top-level config, as for a text model.  ``lift_text_config`` copies the text
config's fields the composite one lacks onto it, once, when the engine config is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# vLLM has no hard cap by default; one large enough never to bite.
DEFAULT_LIMIT = 999
MODALITIES = ("image",)


@dataclass(frozen=True)
class MultiModalConfig:
    """``limit_per_prompt``: the most items of each modality one prompt may carry
    (vLLM's ``limit_mm_per_prompt``)."""

    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": DEFAULT_LIMIT})

    @classmethod
    def from_arg(cls, limit_mm_per_prompt: Any) -> MultiModalConfig:
        """From the engine argument (None or ``{"image": N}``); ``ValueError`` naming
        ``limit_mm_per_prompt``."""
        limits = {"image": DEFAULT_LIMIT}
        if limit_mm_per_prompt is None:
            return cls(limits)
        if not isinstance(limit_mm_per_prompt, dict):
            raise ValueError(f"limit_mm_per_prompt must be a dict like {{'image': 2}}, got "
                             f"{limit_mm_per_prompt!r}")
        for k, v in limit_mm_per_prompt.items():
            if k not in MODALITIES:
                raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (supported: "
                                 f"{', '.join(MODALITIES)})")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0, "
                                 f"got {v!r}")
            limits[k] = v
        return cls(limits)


def is_multimodal_config(hf_config: Any) -> bool:
    """A composite config: a vision tower beside a text decoder."""
    return getattr(hf_config, "vision_config", None) is not None and \
        getattr(hf_config, "text_config", None) is not None


# Fields the engine reads from the top-level config (config.py, arg_utils, worker,
# layers/rotary.py, attention/kinds.py, lora/).
_TEXT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "sliding_window",
    "layer_types", "hidden_act", "attention_bias", "eos_token_id", "bos_token_id")


def lift_text_config(hf_config: Any) -> Any:
    """Copy ``text_config``'s decoder fields that ``hf_config`` lacks onto it (in place;
    idempotent; a text-only config is returned unchanged)."""
    if not is_multimodal_config(hf_config):
        return hf_config
    text = hf_config.text_config
    for name in _TEXT_FIELDS:
        if getattr(hf_config, name, None) is None and getattr(text, name, None) is not None:
            setattr(hf_config, name, getattr(text, name))
    return hf_config
