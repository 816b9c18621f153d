"""LLaVA (``LlavaForConditionalGeneration``): a vision tower, a two-layer projector and a
text decoder; images enter the decoder as rows of its input embeddings.

  pixels -> vision tower -> hidden states of ``vision_feature_layer`` (CLS dropped under
  the "default" strategy) -> linear_1 -> act -> linear_2 -> [patches, text hidden]
  = one image's placeholder rows (``embed_multimodal``; worker/encoder_cache.py puts
  them into the step's ``inputs_embeds``)

The decoder is one of the registered text models (``language_model``, built from
``text_config``), so the KV cache, attention, quantisation and CUDA graphs of text-only
steps are exactly the text model's.  Checkpoint names, all accepted:
``language_model.model.*`` / ``language_model.lm_head.*`` (LLaVA-HF checkpoints),
``model.language_model.*`` / ``lm_head.*`` (transformers 5 modules),
``[model.]vision_tower.[vision_model.]*`` and ``[model.]multi_modal_projector.*``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import current_parallel_state
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.clip_vision import CLIPVisionModel, vision_activation
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.siglip_vision import SiglipVisionModel
from pagedllm.models.vlm_base import TextDecoderDelegate

# The text decoders a LLaVA checkpoint may carry, by ``text_config.model_type`` (the
# registry's classes; imported here, not looked up, so models/ has no import cycle).
TEXT_MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
VISION_TOWERS: dict[str, type[nn.Module]] = {
    "clip_vision_model": CLIPVisionModel, "siglip_vision_model": SiglipVisionModel,
}

_TEXT = re.compile(r"^(?:model\.)?language_model\.(?:(model|lm_head)\.)?(.*)$")
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(TextDecoderDelegate):
    """The model interface of ``LlamaForCausalLM`` plus ``embed_multimodal``."""

    supports_multimodal = True

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        if current_parallel_state().pp.world_size > 1:  # the runner embeds on one stage
            raise ValueError("pipeline_parallel_size > 1 is not supported for LLaVA")
        self.config = hf_config
        text, vision = hf_config.text_config, hf_config.vision_config
        text_cls = TEXT_MODELS.get(getattr(text, "model_type", ""))
        tower_cls = VISION_TOWERS.get(getattr(vision, "model_type", ""))
        if text_cls is None:
            raise ValueError(f"text_config.model_type: {text.model_type!r} is not supported "
                             f"under LLaVA ({', '.join(TEXT_MODELS)})")
        if tower_cls is None:
            raise ValueError(f"vision_config.model_type: {vision.model_type!r} is not "
                             f"supported ({', '.join(VISION_TOWERS)})")
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy: {strategy!r} (default, full)")
        layer = hf_config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = strategy == "default"
        self.vision_tower = tower_cls(vision)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(self.feature_layers), text.hidden_size,
            hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)))
        self.language_model = text_cls(text, backend, quant_config) \
            if quant_config is not None else text_cls(text, backend)

    # -- images -----------------------------------------------------------------------
    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """``pixel_values [images, 3, S, S]`` -> per image ``[patches, text hidden]``."""
        if "pixel_values" not in data:
            raise ValueError("multi_modal_data: the processor gave no pixel_values")
        pixels = data["pixel_values"].to(self.multi_modal_projector.linear_1.weight.dtype)
        states = self.vision_tower.hidden_states(pixels, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        return list(self.multi_modal_projector(torch.cat(states, dim=-1)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Text tensors go to the decoder's ``load_weights`` (its checks included);
        tower and projector tensors are copied here.  ``ValueError`` naming a tensor
        with no parameter or a wrong shape, or listing the parameters not provided."""
        own = {n: p for n, p in self.named_parameters()
               if not n.startswith("language_model.")}
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _TEXT.match(name)
                if m is not None:
                    part, rest = m.groups()
                    yield (f"lm_head.{rest}" if part == "lm_head" else f"model.{rest}"), tensor
                    continue
                if name.startswith("lm_head."):
                    yield name, tensor
                    continue
                m = _VISION.match(name)
                target = f"vision_tower.{m.group(1)}" if m else None
                if m is None:
                    p = _PROJECTOR.match(name)
                    target = f"multi_modal_projector.{p.group(1)}" if p else None
                ignored = getattr(self.vision_tower, "ignored_prefixes", ())
                if m is not None and (m.group(1).endswith("position_ids")
                                      or m.group(1).startswith(ignored)):
                    continue  # a buffer, or a part LLaVA never runs (SigLIP's head)
                if target is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching "
                                     f"parameter in {type(self).__name__}")
                param = own.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching "
                                     f"parameter in {type(self).__name__}")
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r}: shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(target)

        self.language_model.load_weights(text_weights())  # type: ignore[operator]
        missing = sorted(set(own) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {shown}")
