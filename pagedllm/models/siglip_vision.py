"""The SigLIP ViT image tower (transformers' ``SiglipVisionModel``) for LLaVA checkpoints
with a SigLIP config: biased conv patches + learned positions (no class token, no
pre-norm), then CLIP's pre-norm blocks (``clip_vision.VisionEncoderLayer``; SigLIP's
weight names are the same).  The pooling head is never read by LLaVA: its tensors are
skipped at load (``ignored_prefixes``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.models.clip_vision import VisionEncoder, run_encoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(config.num_channels, h, kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding((config.image_size // p) ** 2, h)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values: {tuple(pixels.shape[-2:])} images, the tower "
                             f"takes {self.image_size}x{self.image_size}")
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(w.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """Weights named as transformers' ``SiglipVisionModel`` (without ``vision_model.``)."""

    has_cls = False
    ignored_prefixes = ("head.",)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor,
                      feature_layers: list[int]) -> list[torch.Tensor]:
        return run_encoder(self.encoder.layers, self.embeddings(pixels), feature_layers)
