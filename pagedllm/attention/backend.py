"""The attention backend interface.

A backend owns two operations over the paged KV cache (layout in ``metadata.py``):

* ``write_kv``: store this step's new keys/values at ``slot_mapping`` (slots of -1 are
  skipped: padding tokens of a CUDA-graph batch).
* ``attend``: causal attention of each new query over its request's cached context,
  read only through ``block_tables`` -- including the keys just written.

Both are called by ``layers.attention.Attention`` once per layer per step.  A backend
with ``fuses_rope = True`` also applies rotary embeddings itself (``forward_rope``), so
the model hands it unrotated queries and keys and one kernel rotates and stores them --
and un-normed ones where the layer norms each head first (``QKNorm``: Qwen3, Gemma 3).

KV element types (``attention/kv_cache_dtype.py``): a backend lists the
``kv_cache_dtype`` values it serves in ``kv_cache_dtypes``; with an fp8 cache every
method receives the layer's per-tensor ``k_scale`` / ``v_scale`` (host floats fixed at
load time; ignored for a cache in the model dtype).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import QKNorm, RopeInputs


class AttentionBackend(ABC):
    """Contract: ``forward`` returns ``[num_tokens, num_heads, head_dim]`` in q's dtype,
    where rows ``>= meta.num_actual_tokens`` (padding) may hold anything."""

    name: str = "abstract"
    fuses_rope: bool = False
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def supports(self, kind: AttentionKind) -> bool:
        """Whether ``attend`` implements ``kind`` (``attention/kinds.py``); plain causal
        attention only, unless a backend says more."""
        return kind.is_full

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """key/value: ``[num_tokens, num_kv_heads, head_dim]``; kv_cache: one layer's."""

    @abstractmethod
    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, kind: AttentionKind = FULL, k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """query: ``[num_tokens, num_heads, head_dim]`` -> same shape."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, meta, k_scale, v_scale)
        return self.attend(query, kv_cache, meta, scale, kind, k_scale, v_scale)

    def forward_rope(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """``forward`` on unrotated ``query``/``key`` (un-normed with ``qk_norm``): norm
        and rotate both, then attend."""
        if qk_norm is not None:
            query, key = qk_norm.apply(query, key)
        return self.forward(rope.rotate(query), rope.rotate(key), value, kv_cache, meta,
                            scale, kind, k_scale, v_scale)
