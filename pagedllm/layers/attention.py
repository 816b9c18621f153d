"""The attention layer: shapes q/k/v per head and hands them to the attention backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import QKNorm, RopeInputs


class Attention(nn.Module):
    """Paged causal self-attention over this layer's slice of the KV cache.

    ``kv_cache`` is bound after the KV memory is planned (``bind_kv_caches`` on the model)
    and has the layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.  It is a
    plain attribute, not a buffer: it is not part of the state dict and is never moved by
    ``.to()``.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: AttentionBackend, kind: AttentionKind = FULL) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        if not backend.supports(kind):
            raise ValueError(f"attention backend {backend.name!r} does not support "
                             f"{kind.describe()} attention")
        self.kind = kind
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache = torch.empty(0)
        # Per-tensor scales of an fp8 KV cache (attention/kv_cache_dtype.py): host floats
        # set at load from the checkpoint's k_scale / v_scale, 1.0 otherwise, or from
        # the first real batch (calculate_kv_scales, layers/kv_scales.py).
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The layer's KV cache group (core/kv_cache_groups.py): which block tables and
        # slot mapping it uses when the step has several (set when the KV is bound).
        self.kv_group = 0
        # Armed by the model runner for one forward (layers/kv_scales.py).
        self.calculate_kv_scales = False

    def group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """This layer's group's view of the step's metadata (itself with one group)."""
        return meta.kv_groups[self.kv_group] if meta.kv_groups else meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: RopeInputs | None = None,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        """q: ``[T, num_heads * head_dim]``, k/v: ``[T, num_kv_heads * head_dim]`` (views
        of the fused QKV output are fine) -> ``[T, num_heads * head_dim]``.  With
        ``rope`` given, q and k are unrotated and the backend rotates them (q may be
        rotated in place); with ``qk_norm`` too they are un-normed, and the backend norms
        each head first (fused into its rotation where it can)."""
        if self.kv_cache.numel() == 0:
            raise RuntimeError("Attention.kv_cache is not bound; call "
                               "model.bind_kv_caches(kv_caches) before forward")
        meta = self.group_meta(meta)
        if meta.kv_ready is not None:  # blocks of this step loaded from the host tier
            meta.kv_ready(self.kv_cache)
        t = q.shape[0]
        q3 = q.view(t, self.num_heads, self.head_dim)
        k3 = k.view(t, self.num_kv_heads, self.head_dim)
        v3 = v.view(t, self.num_kv_heads, self.head_dim)
        if qk_norm is not None and (rope is None or self.calculate_kv_scales):
            q3, k3 = qk_norm.apply(q3, k3)  # the scales are taken from the normed keys
            qk_norm = None
        if self.calculate_kv_scales:
            self._calc_kv_scales(k3, v3, meta, rope)
        if rope is not None:
            out = self.backend.forward_rope(q3, k3, v3, self.kv_cache, meta, self.scale, rope,
                                            self.kind, self.k_scale, self.v_scale,
                                            qk_norm=qk_norm)
        else:
            out = self.backend.forward(q3, k3, v3, self.kv_cache, meta, self.scale,
                                       self.kind, self.k_scale, self.v_scale)
        return out.reshape(t, self.num_heads * self.head_dim)

    def _calc_kv_scales(self, k3: torch.Tensor, v3: torch.Tensor, meta: AttentionMetadata,
                        rope: RopeInputs | None) -> None:
        """Set ``k_scale`` / ``v_scale`` from this batch's real tokens, once."""
        from pagedllm.layers.kv_scales import scales_from_amax

        n = meta.num_actual_tokens
        keys = rope.rotate(k3)[:n] if rope is not None else k3[:n]  # as the cache holds them
        self.k_scale, self.v_scale = scales_from_amax(keys, v3[:n])
        self.calculate_kv_scales = False

    def attend_cached(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention only, for queries already rotated whose keys and values are already
        in ``kv_cache`` (the batch-1 QKV kernel writes them: ``kernels/gemv_rope.py``).
        ``q: [T, num_heads * head_dim]`` -> same shape."""
        meta = self.group_meta(meta)
        if meta.kv_ready is not None:
            meta.kv_ready(self.kv_cache)
        t = q.shape[0]
        out = self.backend.attend(q.view(t, self.num_heads, self.head_dim), self.kv_cache,
                                  meta, self.scale, self.kind, self.k_scale, self.v_scale)
        return out.reshape(t, self.num_heads * self.head_dim)
