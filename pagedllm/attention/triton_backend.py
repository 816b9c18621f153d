"""The GPU attention backend: Triton KV-cache write + one-launch paged attention.

CUDA-graph safety: both launches take their grids from host ints only (``num_tokens`` =
``query.shape[0]``, ``meta.num_reqs``, ``meta.max_query_len``, head counts) and never read
a device tensor on the host.  The split-KV choice (see
``pagedllm.kernels.paged_attention.plan_attention``) depends on the number of requests and
the max query length but not on sequence lengths, so a graph captured for a decode batch
size replays correctly at any context length.  Padding tokens (slot -1, beyond
``query_start_loc[num_reqs]``) are skipped by the write and their output rows are left
unwritten.  A graph runner that pads ``num_reqs`` too may add empty requests (query
length 0 -- ``query_start_loc`` repeats its last value -- and seq_len 0); they are no-ops.
``meta.query_limits`` (image runs attending to themselves) reaches the kernel's prompt
programs; such steps run eager (they carry images).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import QKNorm, RopeInputs
from pagedllm.kernels.kv_write import write_kv_cache
from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.kernels.rotary import fuses_qk_norm, rotary_and_write_kv


class TritonAttentionBackend(AttentionBackend):
    """Paged attention on the GPU through the Triton kernels in ``pagedllm.kernels``.

    ``force_num_splits`` pins the split-KV count (1 = never split; tests use it to force
    the flash-decoding path); None lets the host heuristic decide per step.
    """

    name = "triton"
    fuses_rope = True  # rotary + KV write in one launch per layer
    kv_cache_dtypes = ("auto", "fp8")  # fp8: (de)quantised in the kernels' registers

    def __init__(self, force_num_splits: int | None = None) -> None:
        self.force_num_splits = force_num_splits

    def supports(self, kind: AttentionKind) -> bool:
        return True  # full, sliding window and soft-cap: kernel constexpr flags

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, kind: AttentionKind = FULL, k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        return paged_attention(
            query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, scale=scale,
            num_splits=self.force_num_splits, sliding_window=kind.sliding_window,
            soft_cap=kind.logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
            query_limits=meta.query_limits,
        )

    def forward_rope(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        # Query (normed and) rotated in place; rotated keys and the values go straight
        # into the cache.  The per-head norms ride in the same launch where the rotation
        # covers the head.
        norm: dict = {}
        if qk_norm is not None:
            if fuses_qk_norm(query.shape[-1], rope.cos_sin_cache.shape[-1]):
                norm = dict(q_norm_weight=qk_norm.q.weight, k_norm_weight=qk_norm.k.weight,
                            norm_eps=qk_norm.eps, gemma_norm=qk_norm.gemma)
            else:
                query, key = qk_norm.apply(query, key)
        rotary_and_write_kv(rope.positions, query, key, value, query.shape[-1],
                            rope.cos_sin_cache, kv_cache, meta.slot_mapping,
                            k_scale=k_scale, v_scale=v_scale, **norm)
        return self.attend(query, kv_cache, meta, scale, kind, k_scale, v_scale)
