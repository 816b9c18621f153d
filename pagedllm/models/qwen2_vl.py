"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a dynamic-resolution vision tower
(``models/qwen2_vl_vision.py``) and a Qwen2 decoder with M-RoPE (``layers/mrope.py``).

  pixels [patches, C*T*P*P] + image_grid_thw -> tower -> [grid tokens, text hidden]
  = one image's placeholder rows (``embed_multimodal``; worker/encoder_cache.py)

**Positions** (transformers' ``get_rope_index``): text tokens count 0, 1, 2, ... on all
three rows; an image's ``t x h x w`` merged tokens (``h, w``: the grid over the 2x2
merge) sit at ``(start + t', start + h', start + w')``; the text after it continues
from ``start + max(h, w)``.  The runner asks ``get_mrope_input_positions`` once per
request (``worker/mrope_positions.py``); every later token (decode, or prompt tokens
past the prompt after a preemption) is at ``sequence position + delta`` on all rows,
``delta = max prompt position + 1 - prompt length`` (transformers' ``rope_deltas``).
A text-only request's three rows are equal, which is plain RoPE.

Checkpoint names, all accepted: ``visual.*`` / ``model.visual.*`` (tower),
``model.*`` / ``model.language_model.*`` (decoder), ``lm_head.*``.  The Conv3d patch
weight ``[E, C, T, P, P]`` loads flattened into the patch embedding's linear.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.mrope import MRotaryEmbedding
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.rotary import rope_parameters
from pagedllm.models.llama import head_dim_of
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_vl_vision import Qwen2VisionTransformer
from pagedllm.models.vlm_base import TextDecoderDelegate
from pagedllm.multimodal.inputs import MultiModalFeature

_VISION = re.compile(r"^(?:model\.)?visual\.(.*)$")
_TEXT = re.compile(r"^model\.(?:language_model\.)?(.*)$")


def mrope_input_positions(num_tokens: int, features: list[MultiModalFeature],
                          merge: int) -> tuple[np.ndarray, int]:
    """``(positions [3, num_tokens] int64, delta)`` of a prompt whose images are
    ``features`` (sorted, each with its ``image_grid_thw``); see the module doc."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur = prev = 0
    for f in features:
        n = f.offset - prev  # text before the image
        pos[:, prev:f.offset] = np.arange(cur, cur + n)
        cur += n
        t, h, w = (int(v) for v in f.data["image_grid_thw"].to_numpy().reshape(3))
        gh, gw = h // merge, w // merge
        if t * gh * gw != f.length:
            raise ValueError(f"multi_modal_data: an image grid {t}x{h}x{w} gives "
                             f"{t * gh * gw} tokens, its placeholder run has {f.length}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, f.offset:f.end] = np.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(h, w) // merge
        prev = f.end
    pos[:, prev:] = np.arange(cur, cur + num_tokens - prev)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


class Qwen2VLForConditionalGeneration(TextDecoderDelegate):
    """The model interface of ``LlamaForCausalLM`` plus ``embed_multimodal`` and the
    M-RoPE hook ``get_mrope_input_positions`` (``uses_mrope``: the runner passes
    positions ``[3, T]``)."""

    supports_multimodal = True
    uses_mrope = True
    qwen2_5 = False

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        text, vision = hf_config.text_config, hf_config.vision_config
        if getattr(hf_config, "tie_word_embeddings", False):
            text.tie_word_embeddings = True
        self.merge = int(vision.spatial_merge_size)
        self.visual = Qwen2VisionTransformer(vision, self.qwen2_5)
        self.language_model = Qwen2ForCausalLM(text, backend, quant_config) \
            if quant_config is not None else Qwen2ForCausalLM(text, backend)
        self.language_model.model.rotary_emb = MRotaryEmbedding(
            head_dim_of(text), text.max_position_embeddings, rope_parameters(text))

    # -- images and positions ---------------------------------------------------------
    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """``pixel_values [images, patches, C*T*P*P]`` (or all images' patches
        concatenated) and ``image_grid_thw [images, 3]`` -> per image
        ``[t * h * w / merge^2, text hidden]``."""
        if "pixel_values" not in data or "image_grid_thw" not in data:
            raise ValueError("multi_modal_data: the processor gave no pixel_values / "
                             "image_grid_thw")
        grid = data["image_grid_thw"].reshape(-1, 3)
        pixels = data["pixel_values"]
        out = self.visual(pixels.reshape(-1, pixels.shape[-1]), grid)
        sizes = (grid.prod(-1) // (self.merge * self.merge)).tolist()
        return list(out.split(sizes))

    def get_mrope_input_positions(self, prompt_token_ids: list[int],
                                  mm_features: list[MultiModalFeature],
                                  ) -> tuple[np.ndarray, int]:
        """``(positions [3, prompt length], delta)``: see ``mrope_input_positions``."""
        return mrope_input_positions(len(prompt_token_ids), mm_features, self.merge)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Decoder tensors go to the decoder's ``load_weights`` (its checks included);
        tower tensors are copied here.  ``ValueError`` naming a tensor with no parameter
        or a wrong shape, or listing the parameters not provided."""
        own = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _VISION.match(name)
                if m is None:
                    t = _TEXT.match(name)
                    yield (f"model.{t.group(1)}" if t else name), tensor
                    continue
                target = m.group(1)
                param = own.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching "
                                     f"parameter in {type(self).__name__}")
                if target == "patch_embed.proj.weight":  # Conv3d -> linear
                    tensor = tensor.reshape(tensor.shape[0], -1)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r}: shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(target)

        self.language_model.load_weights(text_weights())
        missing = sorted(set(own) - loaded)
        if missing:
            shown = ", ".join(f"visual.{m}" for m in missing[:5])
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {shown}"
                             + (" ..." if len(missing) > 5 else ""))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder and positions; the tower has RMSNorm, a SwiGLU MLP
    and window attention (``models/qwen2_vl_vision.py``)."""

    qwen2_5 = True
