"""The CPU attention backend: the torch reference, with decode steps in one C call.

A step in which every request has one new token (the steady state of generation) runs
rotation, KV write and attention in ``cpu/decode_attention.py``, one call per layer;
every other step (prompts, chunks, speculative verification), other dtypes and an fp8
cache take ``TorchReferenceBackend``, which stays the oracle the tests compare with.
"""

from __future__ import annotations

import torch

from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.cpu import decode_attention


class CpuBackend(TorchReferenceBackend):
    """``TorchReferenceBackend`` plus the fused C decode path (module doc)."""

    name = "cpu"
    fuses_rope = True  # the model hands over unrotated q and k

    def forward_rope(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        if decode_attention.applies(query, key, value, kv_cache, meta):
            return decode_attention.run(query, key, value, kv_cache, meta, scale, rope, kind)
        return super().forward_rope(query, key, value, kv_cache, meta, scale, rope, kind,
                                    k_scale, v_scale)
