"""Sliding-window and soft-capped attention: the Triton kernel (every launch shape: one
launch, the mixed decode+prompt launch, split-KV decodes) against the torch reference
backend, which is itself checked against a dense per-request definition here."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, make_paged_batch

from pagedllm.attention.kinds import AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.kernels.paged_attention import paged_attention

KINDS = [AttentionKind(sliding_window=8), AttentionKind(sliding_window=21),
         AttentionKind(logits_soft_cap=1.5),
         AttentionKind(sliding_window=13, logits_soft_cap=2.0)]


def _meta(b) -> AttentionMetadata:
    qsl = b.query_start_loc.cpu()
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=b.num_reqs, max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_tables=b.block_tables, slot_mapping=b.slot_mapping, query_start_loc_cpu=qsl,
        seq_lens_cpu=b.seq_lens.cpu(), block_size=b.kv_cache.shape[2])


def _dense(b, scale: float, kind: AttentionKind) -> torch.Tensor:
    """The definition: per request, per query, softmax over its visible keys."""
    out = torch.empty(b.query.shape)
    start = 0
    for r, q_len in enumerate(b.query_lens):
        k, v = b.ctx_k[r], b.ctx_v[r]
        s_len, gqa = k.shape[0], b.query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
        for i in range(q_len):
            p = s_len - q_len + i
            lo = 0 if kind.sliding_window is None else max(0, p - kind.sliding_window + 1)
            q = b.query[start + i].float().cpu()
            s = torch.einsum("hd,shd->hs", q, k[lo:p + 1]) * scale
            if kind.logits_soft_cap:
                s = torch.tanh(s / kind.logits_soft_cap) * kind.logits_soft_cap
            out[start + i] = torch.einsum("hs,shd->hd", s.softmax(-1), v[lo:p + 1])
        start += q_len
    return out


def _batch(q_lens, ctx_lens, seed: int):
    return make_paged_batch(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_dim=32,
                            block_size=16, dtype=torch.float32, device=DEVICE,
                            gen=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.describe())
def test_reference_matches_definition(kind: AttentionKind) -> None:
    b = _batch([1, 19, 1, 40], [37, 11, 5, 0], seed=1)
    ref = TorchReferenceBackend().attend(b.query, b.kv_cache, _meta(b), 0.7, kind)
    torch.testing.assert_close(ref.cpu(), _dense(b, 0.7, kind), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.describe())
@pytest.mark.parametrize("launch", ["one", "mixed", "split"])
def test_triton_matches_reference(kind: AttentionKind, launch: str) -> None:
    if launch == "split":  # decode-only: flash-decoding splits over the window's tiles
        b = _batch([1, 1, 1], [70, 9, 33], seed=2)
    else:
        b = _batch([1, 19, 1, 40], [37, 11, 5, 0], seed=3)
    meta = _meta(b)
    ref = TorchReferenceBackend().attend(b.query, b.kv_cache, meta, 0.7, kind)
    got = paged_attention(
        b.query, b.kv_cache, b.block_tables, b.seq_lens, b.query_start_loc,
        num_reqs=b.num_reqs, max_query_len=b.max_query_len, scale=0.7,
        num_splits={"one": 1, "mixed": None, "split": 4}[launch],
        sliding_window=kind.sliding_window, soft_cap=kind.logits_soft_cap)
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("launch", ["one", "mixed", "split"])
def test_triton_head_dim_256_with_window_and_soft_cap(launch: str) -> None:
    """Gemma 2/3's shape (issue 43): head_dim 256, a soft-cap and a sliding window, GQA
    2:1, against the dense definition."""
    kind = AttentionKind(sliding_window=20, logits_soft_cap=50.0)
    q_lens, ctx = ([1, 1], [45, 12]) if launch == "split" else ([1, 23, 1], [30, 9, 0])
    b = make_paged_batch(q_lens, ctx, num_heads=4, num_kv_heads=2, head_dim=256,
                         block_size=16, dtype=torch.float32, device=DEVICE,
                         gen=torch.Generator().manual_seed(5))
    got = paged_attention(
        b.query, b.kv_cache, b.block_tables, b.seq_lens, b.query_start_loc,
        num_reqs=b.num_reqs, max_query_len=b.max_query_len, scale=256 ** -0.5,
        num_splits={"one": 1, "mixed": None, "split": 4}[launch],
        sliding_window=kind.sliding_window, soft_cap=kind.logits_soft_cap)
    torch.testing.assert_close(got.cpu(), _dense(b, 256 ** -0.5, kind), atol=2e-5, rtol=1e-5)
