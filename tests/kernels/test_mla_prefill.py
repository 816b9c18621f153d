"""The varlen MLA prefill kernel (kernels/mla_prefill.py) against a torch reference written
from its definition, and against the model backend's expanded form
(``MLATorchBackend``, SDPA per request): ragged batches of whole prompts, chunks after
cached context and single-token queries; the tests' tiny head dims (Dn 16, R 8, Dv 12:
padded and masked) and V2-Lite's (128 / 64 / 128); fp32 and bf16; then the default
launch plan compiled for sm_90 (no spills, within shared memory)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from kernel_refs import DEVICE, assert_close

from pagedllm.kernels.mla_prefill import MlaPrefillLaunch, mla_prefill, plan_mla_prefill

TINY = (16, 8, 12)  # Dn, R, Dv
V2_LITE = (128, 64, 128)


def mla_prefill_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                    k_pe: torch.Tensor, v: torch.Tensor, q_lens: list[int],
                    k_lens: list[int], scale: float) -> torch.Tensor:
    """The definition, per request in fp32: scores ``q_nope . k_nope[h] + q_pe . k_pe``
    (k_pe shared by the heads), query ``i`` sees positions ``0 .. k_len - q_len + i``;
    rows of requests without context stay zero."""
    t, h, _ = q_nope.shape
    out = torch.zeros(t, h, v.shape[-1])
    qs = ks = 0
    for nq, nk in zip(q_lens, k_lens):
        if nk:
            qn, qp = q_nope[qs:qs + nq].float(), q_pe[qs:qs + nq].float()
            kn, kp, vv = (x[ks:ks + nk].float() for x in (k_nope, k_pe, v))
            s = (torch.einsum("qhd,khd->hqk", qn, kn)
                 + torch.einsum("qhr,kr->hqk", qp, kp)) * scale
            last = nk - nq + torch.arange(nq)
            s = s.masked_fill(torch.arange(nk)[None, :] > last[:, None], float("-inf"))
            out[qs:qs + nq] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
        qs, ks = qs + nq, ks + nk
    return out


def _inputs(q_lens: list[int], k_lens: list[int], heads: int, dims: tuple[int, int, int],
            dtype: torch.dtype, seed: int):
    """Random queries and contexts laid out as ``_expanded`` makes them: k_nope and v
    the halves of one ``[S, H, Dn + Dv]`` tensor, k_pe a slice of ``[S, L + R]`` rows
    (strided views, no copies)."""
    dn, r, dv = dims
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(k_lens)
    q = torch.randn(t, heads, dn + r, generator=g)
    kv = torch.randn(s, heads, dn + dv, generator=g)
    lat = torch.randn(s, 32 + r, generator=g)
    q, kv, lat = (x.to(device=DEVICE, dtype=dtype) for x in (q, kv, lat))
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k_pe = lat[:, 32:]

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)

    return q_nope, q_pe, k_nope, k_pe, v, cu(q_lens), cu(k_lens)


def _check(q_lens, k_lens, heads, dims, dtype, seed, launch=None) -> None:
    args = _inputs(q_lens, k_lens, heads, dims, dtype, seed)
    scale = (dims[0] + dims[1]) ** -0.5
    got = mla_prefill(*args, scale, launch=launch)
    ref = mla_prefill_ref(*(a.cpu() for a in args[:5]), q_lens, k_lens, scale)
    assert got.dtype == dtype and got.shape == ref.shape
    rows = torch.cat([torch.full((nq,), bool(nk)) for nq, nk in zip(q_lens, k_lens)])
    assert_close(got[rows.to(got.device)], ref[rows], dtype, seed)


# Whole prompts (q = k), chunks after context (q < k), single-token queries, a query
# run longer than one tile and one that ends exactly on a tile.
RAGGED = ([9, 1, 23, 4, 1, 16], [9, 30, 40, 4, 1, 21])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", [MlaPrefillLaunch(16, 16), MlaPrefillLaunch(32, 16),
                                    MlaPrefillLaunch(16, 32)], ids=["16x16", "32x16", "16x32"])
def test_ragged_tiny_dims(dtype: torch.dtype, launch: MlaPrefillLaunch) -> None:
    """Non-power-of-two head dims, 3 heads: every tile shape, masked and unmasked
    loops (tiles wholly below a program's first query and across the diagonal)."""
    _check(*RAGGED, 3, TINY, dtype, seed=1, launch=launch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_v2_lite_dims(dtype: torch.dtype) -> None:
    """V2-Lite's head dims at the default plan (64 x 64 tiles): a 70-token prompt
    (two query tiles, an unmasked context tile), a chunk after 90 cached tokens and a
    single-token query."""
    _check([70, 5, 1], [70, 95, 66], 2, V2_LITE, dtype, seed=2)


def test_skipped_requests_and_padding_are_left_alone() -> None:
    """A request with an empty context (a decode the absorbed path serves) and rows past
    ``cu_seqlens_q[-1]`` keep what ``out`` held; the others are computed."""
    q_lens, k_lens = [5, 1, 7], [12, 0, 7]
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = _inputs(q_lens, k_lens, 2, TINY,
                                                        torch.float32, seed=3)
    pad = (torch.cat((q_nope, q_nope[:3])), torch.cat((q_pe, q_pe[:3])))
    out = torch.full((16, 2, TINY[2]), 7.0, device=DEVICE)
    mla_prefill(*pad, k_nope, k_pe, v, cu_q, cu_k, 0.3, out=out,
                launch=MlaPrefillLaunch(16, 16))
    ref = mla_prefill_ref(q_nope.cpu(), q_pe.cpu(), k_nope.cpu(), k_pe.cpu(), v.cpu(),
                          q_lens, k_lens, 0.3)
    assert_close(out[:5], ref[:5], torch.float32, 3)
    assert_close(out[6:13], ref[6:13], torch.float32, 3)
    assert bool((out[5] == 7.0).all()) and bool((out[13:] == 7.0).all())


def test_refuses_mixed_dtypes_and_shapes() -> None:
    args = list(_inputs([3], [3], 2, TINY, torch.float32, seed=4))
    with pytest.raises(ValueError, match="dtype"):
        mla_prefill(*args[:4], args[4].to(torch.bfloat16), *args[5:], 0.1)
    with pytest.raises(ValueError, match="expected"):
        mla_prefill(args[0], args[1], args[2][:, :1], *args[3:], 0.1)


def test_plan() -> None:
    p = plan_mla_prefill(qk_nope_head_dim=128, v_head_dim=128)
    assert (p.block_m, p.block_n, p.num_warps, p.num_stages) == (64, 64, 4, 2)


# -- the model backend -------------------------------------------------------------


def _backend_batch(q_lens: list[int], seq_lens: list[int], dims, dtype, seed: int,
                   block_size: int = 4):
    """A latent cache with shuffled blocks, its metadata, queries and a kv_b weight."""
    from pagedllm.attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 3
    width = dims.kv_lora_rank + dims.qk_rope_head_dim
    cache = torch.randn(1, num_blocks, block_size, 1, width, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(per_req) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = perm[used:used + n]
        used += n
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    t = sum(q_lens)
    h = dims.num_heads
    q = torch.randn(t, h, dims.qk_nope_head_dim + dims.qk_rope_head_dim, generator=g)
    w = torch.randn(h * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                    generator=g) * dims.kv_lora_rank ** -0.5
    dev = torch.device(DEVICE)
    meta = AttentionMetadata(
        num_actual_tokens=t, num_reqs=len(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.to(dev), seq_lens=seq.to(dev),
        block_tables=tables.to(dev), slot_mapping=torch.full((t,), -1, device=dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, block_size=block_size)
    q = q.to(dev, dtype)
    return (q[..., :dims.qk_nope_head_dim], q[..., dims.qk_nope_head_dim:],
            cache.to(dev, dtype), meta, w.to(dev, dtype))


@pytest.mark.parametrize("mode", ["expanded", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_triton_equals_sdpa(mode: str, dtype: torch.dtype) -> None:
    """``MLATorchBackend`` with the kernel (forced on the CPU) equals its SDPA path: the
    loop-free gather through the block tables, the skipped decodes of an "auto" step
    (served by the absorbed form either way)."""
    from pagedllm.attention.mla_torch import MLADims, MLATorchBackend

    dims = MLADims(num_heads=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=12)
    q_lens, seq_lens = [6, 1, 13, 2, 1], [6, 17, 21, 9, 3]
    q_nope, q_pe, cache, meta, w = _backend_batch(q_lens, seq_lens, dims, dtype, seed=5)
    outs = {}
    for path in ("sdpa", "triton"):
        backend = MLATorchBackend()
        backend.kernel_on_cpu = path == "triton"
        outs[path] = backend.forward(q_nope, q_pe, cache, meta, 0.25, w, dims, mode)
    # Both are checked against fp32 arithmetic: SDPA on the CPU computes bf16 inputs in
    # fp32 as well, and the kernel's products are fp32 over bf16 operands (P rounded).
    assert_close(outs["triton"], outs["sdpa"].float(), dtype, 5, scale=2.0)
    ref = _backend_ref(q_nope, q_pe, cache, meta, w, dims, 0.25)
    expanded = [r for r, n in enumerate(q_lens) if mode == "expanded" or n > 1]
    rows = torch.cat([torch.arange(sum(q_lens[:r]), sum(q_lens[:r + 1])) for r in expanded])
    assert_close(outs["triton"].cpu()[rows], ref[rows], dtype, 5, scale=2.0)


def test_backend_fp8_cache() -> None:
    """Over an e4m3 latent cache the loop-free gather moves bytes and dequantises
    (``* k_scale``) as the SDPA path does: the two paths agree."""
    from pagedllm.attention.mla_torch import MLADims, MLATorchBackend

    dims = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=12)
    q_nope, q_pe, cache, meta, w = _backend_batch([7, 3], [7, 18], dims, torch.float32,
                                                  seed=6)
    cache = cache.to(torch.float8_e4m3fn)
    outs = {}
    for path in ("sdpa", "triton"):
        backend = MLATorchBackend()
        backend.kernel_on_cpu = path == "triton"
        outs[path] = backend.forward(q_nope, q_pe, cache, meta, 0.25, w, dims, "expanded",
                                     k_scale=0.5)
    assert_close(outs["triton"], outs["sdpa"], torch.float32, 6)


def _backend_ref(q_nope, q_pe, cache, meta, w, dims, scale) -> torch.Tensor:
    """The expanded form from the definition, per request in fp32 (mla_prefill_ref over
    each request's gathered, up-projected context)."""
    bs = cache.shape[2]
    qsl = meta.query_start_loc_cpu.tolist()
    parts = []
    for r, n in enumerate(meta.seq_lens_cpu.tolist()):
        blocks = meta.block_tables.cpu()[r, :-(-n // bs)].long()
        lat = cache.cpu().float()[0, blocks].flatten(0, 1)[:n, 0]
        kv = (lat[:, :dims.kv_lora_rank] @ w.cpu().float().t()).view(
            n, dims.num_heads, -1)
        nq = qsl[r + 1] - qsl[r]
        parts.append(mla_prefill_ref(
            q_nope.cpu()[qsl[r]:qsl[r + 1]], q_pe.cpu()[qsl[r]:qsl[r + 1]],
            kv[..., :dims.qk_nope_head_dim], lat[:, dims.kv_lora_rank:],
            kv[..., dims.qk_nope_head_dim:], [nq], [n], scale))
    return torch.cat(parts)


# -- the model ---------------------------------------------------------------------


def test_tiny_deepseek_triton_equals_default(tmp_path) -> None:
    """A tiny DeepSeek-V2-Lite checkpoint (tests/models/deepseek_tiny.py) through the
    paged latent cache: whole prompts, chunks with context, decodes and a step mixing
    them, with the kernels forced on the CPU, equal the SDPA path's logits to fp32
    rounding (and transformers'), in the "auto" form (prompt kernel + decode kernel) and
    the "expanded" form (every request, single-token queries included, through the
    prompt kernel)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_model
    from tests.models.deepseek_tiny import VOCAB, build
    from tests.models.paged import hf_logits_of, session_for

    hf = build("v2_lite", str(tmp_path))
    cfg = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32").create_engine_config()
    ours = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (21, 14, 9)]
    # Request 0: a 13-token chunk, then an 8-token chunk after it; request 1 prefills
    # whole beside that chunk; request 2 in two chunks of 5 and 4; then a step of
    # decodes of requests 0 and 1.
    schedule = [{0: (0, 13), 2: (0, 5)}, {0: (13, 21), 1: (0, 14), 2: (5, 9)}]

    def run(path: str, mode: str) -> dict[int, torch.Tensor]:
        ours.set_mla_mode(mode)
        ours.mla_backend.kernel_on_cpu = path == "triton"
        try:
            s = session_for((ours, hf, cfg), block_size=4, seed=12)
            got: dict[int, list[torch.Tensor]] = {r: [] for r in range(3)}
            for step in schedule:
                new = {r: prompts[r][a:b] for r, (a, b) in step.items() if b > a}
                for r, logits in s.step(new).items():
                    got[r].append(logits)
            for r, logits in s.step({0: [1], 1: [2]}).items():  # decodes (2 is done)
                got[r].append(logits)
            return {r: torch.cat(v) for r, v in got.items()}
        finally:
            ours.mla_backend.kernel_on_cpu = False
            ours.set_mla_mode("auto")

    for mode in ("auto", "expanded"):
        base, tri = run("sdpa", mode), run("triton", mode)
        for r in range(3):
            torch.testing.assert_close(tri[r], base[r], atol=1e-4, rtol=0,
                                       msg=lambda m, r=r, mode=mode: f"{mode} {r}: {m}")
        ids = prompts[1] + [2]
        torch.testing.assert_close(tri[1], hf_logits_of(hf, ids), atol=1e-4, rtol=0)


# -- sm_90 compile -----------------------------------------------------------------

_SCRIPT = textwrap.dedent(r"""
    import json, sys
    from tests.kernels.sm90_compile import compile_sm90
    from pagedllm.kernels.mla_prefill import _block, _mla_prefill_kernel, plan_mla_prefill

    out = []
    for dn, r, dv, dtype in json.loads(sys.argv[1]):
        p = plan_mla_prefill(qk_nope_head_dim=dn, v_head_dim=dv)
        ty = "*" + dtype
        sig = {"qn_ptr": ty, "qp_ptr": ty, "kn_ptr": ty, "kp_ptr": ty, "v_ptr": ty,
               "out_ptr": ty, "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
               "scale_log2": "fp32", "num_reqs": "i32"}
        strides = ("stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_knt",
                   "stride_knh", "stride_kpt", "stride_vt", "stride_vh", "stride_ot",
                   "stride_oh")
        for k in strides:
            sig[k] = "i32"
        consts = dict(DN=dn, R=r, DV=dv, BLOCK_DN=_block(dn), BLOCK_R=_block(r),
                      BLOCK_DV=_block(dv), BLOCK_M=p.block_m, BLOCK_N=p.block_n,
                      PAD_DN=_block(dn) != dn, PAD_R=_block(r) != r,
                      PAD_DV=_block(dv) != dv, F32_DOT=dtype == "fp32", WHILE_LOOP=False)
        # Pointers and the strides (multiples of 64 at these dims) are specialised as
        # divisible by 16, as the runtime does.
        div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n in strides]
        _, st = compile_sm90(_mla_prefill_kernel, sig, consts,
                             {"num_warps": p.num_warps, "num_stages": p.num_stages}, div)
        out.append({"case": f"prefill {dn}/{r}/{dv} {dtype}", "warps": p.num_warps, **st})
    print(json.dumps(out))
""")


def test_default_plan_fits_sm90(tmp_path) -> None:
    """V2-Lite / V3 dims (bf16 and fp16) at the default plan: no spills, within shared
    memory."""
    pytest.importorskip("triton")
    from tests.kernels.sm90_compile import run_script

    res = run_script(_SCRIPT, tmp_path, json.dumps([[128, 64, 128, "bf16"],
                                                   [128, 64, 128, "fp16"]]))
    for r in res:
        print(r)
        assert r["shared"] <= 227 * 1024, r
        assert r["spill_stores"] == 0, r
