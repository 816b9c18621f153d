"""Gemma 3 with images (``Gemma3ForConditionalGeneration``; the released Gemma 3
checkpoints from 4B up): a SigLIP tower, a pooling projector and the Gemma 3 decoder.

  pixels [3, S, S] -> SigLIP -> post_layernorm -> [P*P patches, vision hidden]
     -> avg-pool P x P to T x T (T*T = mm_tokens_per_image) -> mm_soft_emb_norm
     (Gemma RMSNorm, 1 + weight) -> @ mm_input_projection_weight -> [T*T, text hidden]
     = one image's placeholder rows (``embed_multimodal``)

The prompt holds ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x
``<image_soft_token>`` + ``<end_of_image>\\n\\n`` per image (the processor expands it);
only the soft tokens are the placeholder run.  Text rows are the decoder's scaled
embeddings; image rows are not scaled (transformers scales inside the embedding layer).

**Image tokens attend to their whole run.**  transformers marks the soft tokens with
``token_type_ids`` and lets the tokens of one image see each other bidirectionally, on
full and sliding layers alike (full: causal OR same image; sliding: window AND (causal OR
same image)).  Here ``whole_placeholder_runs = True`` asks the engine for exactly that:

* the model runner gives attention a per-token key limit (``AttentionMetadata.
  query_limits``: the last position of the query's run; ``worker/encoder_cache.py``),
* the scheduler never splits a run across steps (``core/encoder_budget.py``), so every
  key a query may see is written in the step it runs,
* a prefix-cache hit may end inside a run: its blocks' keys were computed with the whole
  run, and the same hash means the same image at the same place, so they are the keys
  this request would compute; the rest of the run then computes in one step.

Pan-and-scan is off unless the processor is configured for it (transformers' default);
its crops are further images, each its own run.  Checkpoint names are LLaVA's
(``models/llava.py`` loads them): ``model.language_model.*``, ``lm_head.*``,
``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.gemma import Gemma3ForCausalLM
from pagedllm.models.llava import LlavaForConditionalGeneration
from pagedllm.models.siglip_vision import SiglipVisionModel


class Gemma3MultiModalProjector(nn.Module):
    """``[images, P*P, vision hidden] -> [images, T*T, text hidden]`` (module doc)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or \
                self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image: {config.mm_tokens_per_image} is not a "
                             f"square dividing the {self.patches_per_side}^2 patch grid")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h = x.shape
        p = self.patches_per_side
        grid = x.transpose(1, 2).reshape(b, h, p, p)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel)
        normed = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA's model interface and weight loading with Gemma 3's parts (module doc)."""

    supports_multimodal = True
    # A query in an image's placeholder run sees keys up to the end of its run.
    whole_placeholder_runs = True

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        vision = hf_config.vision_config
        if getattr(vision, "model_type", "") != "siglip_vision_model":
            raise ValueError(f"vision_config.model_type: {vision.model_type!r} (Gemma 3 "
                             "takes siglip_vision_model)")
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)
        self.language_model = Gemma3ForCausalLM(hf_config.text_config, backend,
                                                quant_config)

    @staticmethod
    def max_placeholder_run(hf_config: Any) -> int:
        """The longest placeholder run (one image, or one pan-and-scan crop)."""
        return int(hf_config.mm_tokens_per_image)

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """``pixel_values [images, 3, S, S]`` -> per image ``[mm_tokens_per_image, text
        hidden]`` (transformers' ``get_image_features``)."""
        if "pixel_values" not in data:
            raise ValueError("multi_modal_data: the processor gave no pixel_values")
        tower = self.vision_tower
        pixels = data["pixel_values"].to(self.multi_modal_projector.
                                         mm_input_projection_weight.dtype)
        last = tower.hidden_states(pixels, [-1])[0]
        return list(self.multi_modal_projector(tower.post_layernorm(last)))

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings; an image token outside the vocabulary embeds as id 0
        (its row is overwritten by the image), as transformers does."""
        lm = self.language_model
        if self.image_token_id >= lm.config.vocab_size:
            input_ids = torch.where(input_ids == self.image_token_id, 0, input_ids)
        return lm.get_input_embeddings(input_ids)  # type: ignore[operator]
