"""The CPU attention backend: the torch reference, with decode steps in one C call.

A step in which every request has one new token (the steady state of generation) runs
rotation, KV write and attention in ``cpu_decode.py``, one call per layer;
every other step (prompts, chunks, speculative verification), other dtypes and an fp8
cache take ``TorchReferenceBackend``, which stays the oracle the tests compare with.

In a mixed step (some requests decode one token while others compute prompt tokens)
the one-token requests' outputs come from the C kernel too, so that a token's result
does not depend on what else shares its step: the C kernel and torch sum in different
orders (equal to float32 rounding, not bitwise), and a near-tied greedy choice could
otherwise differ between a request run alone and the same request batched.  The torch
reference still writes every row's keys and values (the C kernel writes the same bits
for its rows, tested) and computes the others.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.attention import cpu_decode
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs
from pagedllm.attention.torch_ref import TorchReferenceBackend


class CpuBackend(TorchReferenceBackend):
    """``TorchReferenceBackend`` plus the fused C decode path (module doc)."""

    name = "cpu"
    fuses_rope = True  # the model hands over unrotated q and k

    def forward_rope(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        if cpu_decode.applies(query, key, value, kv_cache, meta):
            return cpu_decode.run(query, key, value, kv_cache, meta, scale, rope, kind)
        if not (meta.num_reqs > 1 and not meta.kv_groups and query.shape[0] ==
                meta.num_actual_tokens and cpu_decode.takes_rows(query, key, value,
                                                                 kv_cache)):
            return super().forward_rope(query, key, value, kv_cache, meta, scale, rope,
                                        kind, k_scale, v_scale)
        # A mixed step: the torch reference writes every row's K/V and attends the
        # prompt rows only; the one-token rows come from the C kernel (module doc).
        self.write_kv(rope.rotate(key), value, kv_cache, meta, k_scale, v_scale)
        out = self.attend(rope.rotate(query), kv_cache, meta, scale, kind, k_scale,
                          v_scale, decodes=False)
        self._decode_rows(out, query, key, value, kv_cache, meta, scale, rope, kind)
        return out

    @staticmethod
    def _decode_rows(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, rope: RopeInputs, kind: AttentionKind) -> None:
        """Overwrite ``out``'s rows of the one-token requests of a mixed step with the C
        decode kernel's results (module doc); ``query`` is left as it was."""
        starts = meta.query_start_loc_cpu
        one = (starts[1:] - starts[:-1]) == 1
        if not bool(one.any()):
            return
        reqs = one.nonzero().flatten()
        rows = starts[:-1][reqs].long()
        dev = query.device
        sub = dataclasses.replace(
            meta, num_actual_tokens=len(rows), num_reqs=len(rows), max_query_len=1,
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
            query_start_loc_cpu=torch.arange(len(rows) + 1, dtype=torch.int32),
            seq_lens=meta.seq_lens[reqs], seq_lens_cpu=meta.seq_lens_cpu[reqs],
            block_tables=meta.block_tables[reqs], slot_mapping=meta.slot_mapping[rows])
        sub_rope = RopeInputs(rope.positions[rows], rope.cos_sin_cache, rope.dtype)
        out[rows] = cpu_decode.run(query[rows], key[rows], value[rows], kv_cache, sub,
                                   scale, sub_rope, kind)
