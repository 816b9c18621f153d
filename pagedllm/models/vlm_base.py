"""The text half of a vision-language model's interface, shared by its families.

A VLM class (``llava.py``, ``qwen2_vl.py``, ``gemma3_mm.py``) holds its decoder as
``self.language_model`` (a registered causal LM) and adds the vision side itself
(``embed_multimodal``, weight loading, positions).  Everything the model runner asks of
the text model is the decoder's own: this base forwards it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata


class TextDecoderDelegate(nn.Module):
    """Forwards the text model's interface (``LlamaForCausalLM``'s docstring) to
    ``self.language_model``, which a subclass sets in its ``__init__``."""

    language_model: nn.Module

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings(input_ids)  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_only: bool = False,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[T]``, or ``[3, T]`` for a decoder with M-RoPE rows."""
        return self.language_model(input_ids, positions, meta, last_only, intermediate,
                                   inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # type: ignore[operator]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.language_model.bind_kv_caches(kv_caches)  # type: ignore[operator]
