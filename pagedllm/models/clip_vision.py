"""The CLIP ViT image tower (transformers' ``CLIPVisionModel``), as LLaVA reads it.

  pixels [B, 3, S, S] -> conv patches (+ CLS) + positions -> pre-norm
    -> [ norm -> self-attention (all tokens, no mask) -> +res -> norm -> MLP -> +res ] x L

``hidden_states(pixels, layers)`` returns the residual stream after the given layers in
transformers' numbering (0: the embeddings, k: the output of layer k, negative from the
end: -2 is the second-to-last layer's output, LLaVA's default), running only the layers
needed.  The tower is small next to the decoder: plain ``nn.Linear`` layers, replicated
on every tensor-parallel rank, unquantised, run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str) -> Any:
    """transformers' ``hidden_act`` names used by vision towers."""
    acts = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
            "gelu": F.gelu,
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
    if name not in acts:
        raise ValueError(f"vision_config.hidden_act: {name!r} is not supported "
                         f"({', '.join(acts)})")
    return acts[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens (q/k/v/out biased)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)),
                                             split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """A pre-norm ViT block (CLIP's and SigLIP's share it, with their weight names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(h, eps=eps)
        self.self_attn = VisionAttention(h, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps)
        self.mlp = VisionMLP(h, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config)
                                    for _ in range(config.num_hidden_layers))


def run_encoder(layers: nn.ModuleList, x: torch.Tensor,
                feature_layers: list[int]) -> list[torch.Tensor]:
    """The residual stream at each of ``feature_layers`` (transformers' hidden-state
    indices: 0 = ``x``, k = after layer k, negative from the end), running only the
    layers up to the deepest one asked for."""
    n = len(layers)
    idx = [i if i >= 0 else n + 1 + i for i in feature_layers]
    if any(not 0 <= i <= n for i in idx):
        raise ValueError(f"vision_feature_layer {feature_layers} is out of range for a "
                         f"{n}-layer vision tower")
    states = {0: x}
    for k in range(max(idx)):
        x = layers[k](x)
        states[k + 1] = x
    return [states[i] for i in idx]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(h))
        self.patch_embedding = nn.Conv2d(config.num_channels, h, kernel_size=p, stride=p,
                                         bias=False)
        self.position_embedding = nn.Embedding((config.image_size // p) ** 2 + 1, h)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values: {tuple(pixels.shape[-2:])} images, the tower "
                             f"takes {self.image_size}x{self.image_size}")
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(w.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionModel(nn.Module):
    """Weights named as transformers' ``CLIPVisionModel`` (without ``vision_model.``).
    ``has_cls``: its first token is the class token (LLaVA's "default" strategy drops
    it)."""

    has_cls = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config)
        # Only the pooled (CLS) output reads it; loaded so the checkpoint maps whole.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor,
                      feature_layers: list[int]) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixels))
        return run_encoder(self.encoder.layers, x, feature_layers)
