"""The CPU attention backend: every float32 row through one per-row C kernel.

Batch invariance is this backend's contract: a query row's output depends only on its
own query, its request's cached keys and values and its key count -- never on how many
rows the step has, which other requests share it, or whether the row is a prompt row,
a chunk of a prompt, the recomputed last token of a prefix-cache hit or a decode.  So a
greedy request's tokens and logprobs are bitwise the same alone, batched, chunked,
cached and streamed (``tests/e2e/test_batch_invariance.py``).

Every step with float32 activations and cache therefore runs rotation, KV write and
attention in ``cpu_decode.py`` (one C call per layer): all rows' keys and values are
written first, then each row attends to its request's first ``n`` keys, where ``n`` is
its position in the request plus one (``row_plan``), with the kernel's fixed per-row
order of operations.  That is the decode kernel itself -- a prompt row is a decode row
that sees fewer keys -- as llama.cpp runs one attention kernel for every row.  (Torch's
SDPA, which the reference uses for prompt chunks, blocks its query and key loops by
sequence length: a row's sums there depend on the chunk it sits in.)

Other dtypes, an fp8 cache, hybrid KV groups and per-token key limits (image runs) take
``TorchReferenceBackend``, which stays the oracle the tests compare with (to float32
rounding, not bitwise).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.attention import cpu_decode
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import QKNorm, RopeInputs
from pagedllm.attention.torch_ref import TorchReferenceBackend


def row_plan(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` recast with one "request" per query row, as ``cpu_decode.run`` reads it:
    row ``i`` of request ``r`` (rows ``s..e-1``) gets ``r``'s block table and the key
    count ``seq_lens[r] - (e - 1 - i)`` (itself and every key before it).  Host ops
    only (the CPU backend's tensors are host tensors)."""
    qsl = meta.query_start_loc_cpu[:meta.num_reqs + 1].long()
    lens = qsl[1:] - qsl[:-1]
    t = meta.num_actual_tokens
    req = torch.repeat_interleave(torch.arange(meta.num_reqs), lens)
    after = qsl[1:].index_select(0, req) - 1 - torch.arange(t)
    seq = meta.seq_lens_cpu[:meta.num_reqs].long().index_select(0, req) - after
    return dataclasses.replace(
        meta, num_reqs=t, max_query_len=1,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(t + 1, dtype=torch.int32),
        seq_lens=seq.to(torch.int32), seq_lens_cpu=seq.to(torch.int32),
        block_tables=meta.block_tables.index_select(0, req))


class CpuBackend(TorchReferenceBackend):
    """``TorchReferenceBackend`` with every float32 row on the per-row C kernel (module
    doc)."""

    name = "cpu"
    fuses_rope = True  # the model hands over unrotated q and k

    def __init__(self) -> None:
        super().__init__()
        # The last step's metadata and its row plan: every layer of a step reads the same
        # metadata object, so the plan is made once per step (the reference to ``meta``
        # keeps its identity from being reused by a later step's object).
        self._rows: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def forward_rope(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind = FULL, k_scale: float = 1.0, v_scale: float = 1.0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        if qk_norm is not None:  # the layer's own norm modules (one fused C call each)
            query, key = qk_norm.apply(query, key)
        if cpu_decode.applies(query, key, value, kv_cache, meta):
            return cpu_decode.run(query, key, value, kv_cache, meta, scale, rope, kind)
        if (meta.kv_groups or meta.query_limits is not None or meta.num_actual_tokens == 0
                or query.shape[0] != meta.num_actual_tokens
                or not cpu_decode.takes_rows(query, key, value, kv_cache)):
            return super().forward_rope(query, key, value, kv_cache, meta, scale, rope,
                                        kind, k_scale, v_scale)
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, row_plan(meta))
        return cpu_decode.run(query, key, value, kv_cache, self._rows[1], scale, rope, kind)
