"""Per-token key limits (``AttentionMetadata.query_limits``: the queries of an image run
see the whole run, Gemma 3): the torch reference against a dense definition, and the
Triton kernel (one launch, the mixed decode+prompt launch) against the reference, with
and without a sliding window and a soft-cap; under ``TRITON_INTERPRET=1`` on CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, make_paged_batch

from pagedllm.attention.kinds import AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.kernels.paged_attention import paged_attention

KINDS = [AttentionKind(), AttentionKind(sliding_window=5),
         AttentionKind(sliding_window=13, logits_soft_cap=2.0)]
Q_LENS, CTX_LENS = [1, 19, 1, 40], [37, 11, 5, 0]
# Per request with several new tokens: an "image run" [a, b) of its new tokens.
RUNS = {1: [(3, 11)], 3: [(0, 4), (9, 30), (33, 40)]}


def _batch(seed: int):
    return make_paged_batch(Q_LENS, CTX_LENS, num_heads=8, num_kv_heads=2, head_dim=32,
                            block_size=16, dtype=torch.float32, device=DEVICE,
                            gen=torch.Generator().manual_seed(seed))


def _limits(b) -> torch.Tensor:
    """Each token's own position, or the last position of its run."""
    out, start = [], 0
    for r, q_len in enumerate(b.query_lens):
        ctx = b.ctx_k[r].shape[0] - q_len
        lim = list(range(ctx, ctx + q_len))
        for a, e in RUNS.get(r, ()):
            lim[a:e] = [ctx + e - 1] * (e - a)
        out += lim
        start += q_len
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def _meta(b, limits: torch.Tensor | None) -> AttentionMetadata:
    qsl = b.query_start_loc.cpu()
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=b.num_reqs, max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_tables=b.block_tables, slot_mapping=b.slot_mapping, query_start_loc_cpu=qsl,
        seq_lens_cpu=b.seq_lens.cpu(), block_size=b.kv_cache.shape[2],
        query_limits=limits)


def _dense(b, scale: float, kind: AttentionKind, limits: torch.Tensor) -> torch.Tensor:
    """The definition (transformers' Gemma 3 image mask): key k is visible to the query at
    position p with limit L when k <= L and, with a window W, k > p - W."""
    out = torch.empty(b.query.shape)
    start = 0
    lim = limits.cpu().tolist()
    for r, q_len in enumerate(b.query_lens):
        k, v = b.ctx_k[r], b.ctx_v[r]
        s_len, gqa = k.shape[0], b.query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
        for i in range(q_len):
            p, hi = s_len - q_len + i, lim[start + i]
            lo = 0 if kind.sliding_window is None else max(0, p - kind.sliding_window + 1)
            q = b.query[start + i].float().cpu()
            s = torch.einsum("hd,shd->hs", q, k[lo:hi + 1]) * scale
            if kind.logits_soft_cap:
                s = torch.tanh(s / kind.logits_soft_cap) * kind.logits_soft_cap
            out[start + i] = torch.einsum("hs,shd->hd", s.softmax(-1), v[lo:hi + 1])
        start += q_len
    return out


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.describe())
def test_reference_matches_definition(kind: AttentionKind) -> None:
    b = _batch(seed=1)
    limits = _limits(b)
    ref = TorchReferenceBackend().attend(b.query, b.kv_cache, _meta(b, limits), 0.7, kind)
    want = _dense(b, 0.7, kind, limits)
    torch.testing.assert_close(ref.cpu(), want, atol=2e-5, rtol=1e-5)
    # The limits matter: plain causal attention differs on the runs' rows.
    causal = TorchReferenceBackend().attend(b.query, b.kv_cache, _meta(b, None), 0.7, kind)
    assert not torch.allclose(causal.cpu(), want, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.describe())
@pytest.mark.parametrize("launch", ["one", "mixed"])
def test_triton_matches_reference(kind: AttentionKind, launch: str) -> None:
    b = _batch(seed=3)
    limits = _limits(b)
    ref = TorchReferenceBackend().attend(b.query, b.kv_cache, _meta(b, limits), 0.7, kind)
    got = paged_attention(
        b.query, b.kv_cache, b.block_tables, b.seq_lens, b.query_start_loc,
        num_reqs=b.num_reqs, max_query_len=b.max_query_len, scale=0.7,
        num_splits={"one": 1, "mixed": None}[launch], sliding_window=kind.sliding_window,
        soft_cap=kind.logits_soft_cap, query_limits=limits)
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=2e-5, rtol=1e-5)


_SM90_SCRIPT = """
    from pagedllm.kernels.paged_attention import _paged_attn_kernel, plan_attention

    p = plan_attention(num_reqs=8, max_query_len=512, num_heads=8, num_kv_heads=4,
                       block_size=16, sm_count=132, num_splits=1, head_dim=256)
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
           "out_ptr": "*bf16", "m_ptr": "*bf16", "l_ptr": "*bf16",
           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
           "limits_ptr": "*i32", "scale_log2": "fp32"}
    for k in ("num_reqs", "num_heads", "num_splits", "stride_qt", "stride_qh",
              "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
              "stride_bt"):
        sig[k] = "i32"
    sig["v_scale"] = "fp32"
    consts = dict(GQA=2, HEAD_DIM=256, DIM_P2=256, BLOCK_SIZE=16, KV_FP8=False,
                  BLOCK_M=p.block_m, BLOCK_Q=p.block_q, TILE_N=p.tile_n, SPLIT=False,
                  F32_DOT=False, WHILE_LOOP=False, Q_FILTER=0, DECODE=False,
                  USE_PDL=True, WINDOW=1024, SOFTCAP=0.0, LIMITS=True)
    st = build(_paged_attn_kernel, sig, consts, 8,
               {"num_warps": p.num_warps, "num_stages": p.num_stages})
    print(json.dumps([st]))
"""


def test_limits_compile_for_sm90(tmp_path) -> None:
    """Gemma 3's shape (head size 256, sliding window) with ``LIMITS``: the prompt plan
    compiles for sm_90 within shared memory, without spills (no GPU needed:
    ``test_attention_smem.py``)."""
    import textwrap

    from tests.kernels.sm90_compile import run_script
    from tests.kernels.test_attention_smem import _BUILD, SM90_MAX_SHARED

    (st,) = run_script(textwrap.dedent(_BUILD + _SM90_SCRIPT), tmp_path, "")
    assert 0 < st["shared"] <= SM90_MAX_SHARED, st
    assert st["spill_stores"] == 0, st
