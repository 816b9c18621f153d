"""The small-M W4A16 kernels on the K-major layout (``kernels/wna16_kmajor.py``): the GEMV
and the dequantise kernel, against ``wna16_tc.w4a16_tc_ref`` / ``IntWeight.dequantize``.

Interpreter cases (``TRITON_INTERPRET=1`` without a GPU): M 1, 3, 8 (block_m 1, 4, 8),
random zero points, the symmetric 8 (explicit and None), group 128 and channel-wise,
steps over several groups (``BLOCK_K > G``), split-K (even and with a short last
chunk), the register prefetch (``ahead``), N not a multiple of BLOCK_N, fp32 / bf16
activations, row-sliced and column-strided ``x``.  Bounds: fp32 against the fp32
reference: ``1e-5`` of the output's max (accumulation order); bf16: ``2**-7`` (the
interpreter truncates to bf16 instead of rounding).  The dequantise kernel is exact (the
interpreter's bf16 rounding is done by hand there).  The sm_90 compile test (ptxas, no
GPU needed) checks the priors for spills and in-loop layout conversions.  GPU timings
and checks: ``benchmarks/wna16_kmajor_sweep.py``."""

from __future__ import annotations

import glob
import importlib
import json
import os
import sys
import textwrap

import pytest
import torch
from kernel_refs import DEVICE

from pagedllm.kernels import wna16_kmajor as km
from pagedllm.kernels.wna16 import dequantize, pack_codes
from pagedllm.kernels.wna16_tc import to_kmajor, w4a16_tc_ref
from pagedllm.layers.quantization.int_layout import IntWeight
from tests.kernels.sm90_compile import run_script


def _weight(n: int, k: int, group: int, zeros: bool, seed: int,
            dtype: torch.dtype = torch.float32):
    """Canonical codes -> the K-major args ``(qweight_t, scales_t, zeros_t)`` (on
    DEVICE) and the canonical ``(qweight, scales, zeros)`` (CPU)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = ((torch.rand(n, groups, generator=g) + 0.5) / k ** 0.5).to(dtype)
    zp = torch.randint(0, 16, (n, groups), generator=g).float() if zeros else None
    qw = pack_codes(codes, 4)
    km_args = (to_kmajor(qw).to(DEVICE), scales.t().contiguous().to(DEVICE),
               None if zp is None else zp.t().contiguous().to(DEVICE))
    return km_args, (qw, scales, zp)


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float().cpu() - ref.float()).abs().max()) / float(ref.float().abs().max())


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("zeros,group", [(True, 128), (False, 128), (True, -1)])
def test_gemv_matches_reference_fp32(m: int, zeros: bool, group: int) -> None:
    """N = 72 over 32-column tiles (the clamped last tile), two 128-input steps a group
    (group 128: a new scale every step; channel-wise: one for all four)."""
    n, k = 72, 512
    args, _ = _weight(n, k, k if group == -1 else group, zeros, m)
    x = _x(m, k, 10 + m)
    bm = 1 if m == 1 else 1 << (m - 1).bit_length()
    got = km.kmajor_gemv(x.to(DEVICE), *args, group, config=(bm, 32, 128, 1, 4, 1))
    ref = w4a16_tc_ref(x, *[None if a is None else a.cpu() for a in args], group)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert _err(got, ref) <= 1e-5


@pytest.mark.parametrize("cfg", [(4, 32, 128, 2, 4, 1),    # 5 steps: chunks of 3 and 2
                                 (4, 64, 64, 4, 4, 1),     # 10 steps: 3, 3, 3, 1
                                 (8, 16, 128, 5, 2, 1)])   # one step a split
def test_gemv_split_k_with_a_short_last_chunk(cfg: tuple[int, ...]) -> None:
    n, k, m = 40, 640, 3
    args, _ = _weight(n, k, 128, True, 3)
    x = _x(m, k, 4)
    got = km.kmajor_gemv(x.to(DEVICE), *args, 128, config=cfg)
    ref = w4a16_tc_ref(x, *[None if a is None else a.cpu() for a in args], 128)
    assert _err(got, ref) <= 1e-5


@pytest.mark.parametrize("cfg,group", [((4, 32, 256, 2, 4, 1), 128),
                                       ((2, 16, 512, 1, 4, 1), 256)])
def test_gemv_steps_over_several_groups(cfg: tuple[int, ...], group: int) -> None:
    """``BLOCK_K`` a multiple of the group: each word row reads its own group's scale
    and zero."""
    n, k, m = 40, 1024, 2
    args, _ = _weight(n, k, group, True, 15)
    x = _x(m, k, 16)
    got = km.kmajor_gemv(x.to(DEVICE), *args, group, config=cfg)
    ref = w4a16_tc_ref(x, *[None if a is None else a.cpu() for a in args], group)
    assert _err(got, ref) <= 1e-5


@pytest.mark.parametrize("m,zeros,split", [(1, True, 1), (3, False, 2), (8, True, 3)])
def test_gemv_register_prefetch_is_bit_identical(m: int, zeros: bool, split: int) -> None:
    """``ahead`` only moves the next step's loads before this step's arithmetic: the
    same bits (640 inputs: split 2 and 3 leave a short last chunk)."""
    n, k = 40, 640
    args, _ = _weight(n, k, 128, zeros, 17)
    x = _x(m, k, 18).to(DEVICE)
    bm = 1 if m == 1 else 1 << (m - 1).bit_length()
    cfg = (bm, 16, 128, split, 2, 1)
    got = km.kmajor_gemv(x, *args, 128, config=cfg + (1,))
    assert torch.equal(got, km.kmajor_gemv(x, *args, 128, config=cfg + (0,)))
    assert torch.equal(got, km.kmajor_gemv(x, *args, 128, config=cfg))
    ref = w4a16_tc_ref(x.cpu(), *[None if a is None else a.cpu() for a in args], 128)
    assert _err(got, ref) <= 1e-5


def test_gemv_priors_split_and_symmetric_zero_none_is_zero_8() -> None:
    """The priors (on CPU: 8 target programs, so 128-column tiles split K 4 ways), and
    ``zeros_t=None`` (the constant 8) bit for bit the explicit zero 8."""
    n, k, m = 24, 512, 2
    args, _ = _weight(n, k, 128, False, 5)
    cfg = km.kmajor_config(m, n, k, torch.device(DEVICE))
    assert cfg[0] == 2 and cfg[3] > 1
    x = _x(m, k, 6).to(DEVICE)
    eight = torch.full_like(args[1], 8.0, dtype=torch.float32)
    got = km.kmajor_gemv(x, args[0], args[1], None, 128)
    got8 = km.kmajor_gemv(x, args[0], args[1], eight, 128)
    assert torch.equal(got, got8)
    ref = w4a16_tc_ref(x.cpu(), args[0].cpu(), args[1].cpu(), None, 128)
    assert _err(got, ref) <= 1e-5


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_bf16(m: int) -> None:
    n, k = 48, 256
    args, (qw, sc, zp) = _weight(n, k, 128, True, 7, torch.bfloat16)
    x = _x(m, k, 8, torch.bfloat16)
    got = km.kmajor_gemv(x.to(DEVICE), *args, 128, config=(m, 32, 64, 2, 4, 1))
    assert got.dtype == torch.bfloat16
    ref = w4a16_tc_ref(x.float(), qw.t().contiguous(), sc.t().contiguous().float(),
                       zp.t().contiguous(), 128)
    assert _err(got, ref) <= 2 ** -7


def test_gemv_strided_x() -> None:
    """A row-sliced view (row stride K + 192) and a column-strided one (copied)."""
    n, k, m = 40, 256, 3
    args, _ = _weight(n, k, 128, True, 9)
    big = _x(m, k + 192, 10)
    sliced = big.to(DEVICE)[:, 64:64 + k]
    assert sliced.stride(0) == k + 192
    ref = w4a16_tc_ref(big[:, 64:64 + k].contiguous(),
                       *[None if a is None else a.cpu() for a in args], 128)
    cfg = (4, 32, 128, 2, 4, 1)
    assert _err(km.kmajor_gemv(sliced, *args, 128, config=cfg), ref) <= 1e-5
    cols = _x(k, m, 10).t()  # stride (1, M)
    ref = w4a16_tc_ref(cols.contiguous(), *[None if a is None else a.cpu() for a in args],
                       128)
    assert _err(km.kmajor_gemv(cols.to(DEVICE), *args, 128, config=cfg), ref) <= 1e-5


@pytest.mark.parametrize("sdt,odt", [(torch.float32, torch.float32),
                                     (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16),
                                     (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("zeros", [True, False])
def test_dequantize_is_exact(sdt: torch.dtype, odt: torch.dtype, zeros: bool) -> None:
    """Bit for bit ``IntWeight.dequantize(out.dtype)`` (computed in the scales' dtype)
    and, where out has the scales' dtype, ``wna16.dequantize(...).to(out.dtype)``;
    N = 72 over 64-row tiles."""
    n, k, group = 72, 384, 128
    args, (qw, sc, zp) = _weight(n, k, group, zeros, 11, sdt)
    out = torch.full((n, k), float("nan"), dtype=odt, device=DEVICE)
    got = km.kmajor_dequantize(*args, group, out).cpu()
    assert torch.equal(got, IntWeight(qw, sc, zp, None, 4, group).dequantize(odt))
    if sdt == odt:
        assert torch.equal(got, dequantize(qw, sc, zp, None, 4, group).to(odt))


def test_dequantize_channelwise_and_wide_tiles() -> None:
    n, k = 40, 512
    args, (qw, sc, zp) = _weight(n, k, k, True, 12)
    out = torch.empty(n, k, device=DEVICE)
    got = km.kmajor_dequantize(*args, -1, out, config=(16, 256, 4)).cpu()
    assert torch.equal(got, dequantize(qw, sc, zp, None, 4, k))


def test_cpu_fallbacks_match_the_kernels(monkeypatch) -> None:
    """Outside the interpreter CPU tensors take the torch references: same results."""
    n, k, m = 24, 256, 3
    args, _ = _weight(n, k, 128, True, 13, torch.bfloat16)
    args = tuple(None if a is None else a.cpu() for a in args)
    x = _x(m, k, 14)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    monkeypatch.setattr(km, "_INTERPRET", True)
    kern_w = km.kmajor_dequantize(*args, 128, out.clone()) if DEVICE == "cpu" else None
    kern_y = km.kmajor_gemv(x, *args, 128) if DEVICE == "cpu" else None
    monkeypatch.setattr(km, "_INTERPRET", False)
    ref_w = km.kmajor_dequantize(*args, 128, out)
    ref_y = km.kmajor_gemv(x, *args, 128)
    assert torch.equal(ref_y, w4a16_tc_ref(x, *args, 128))
    if kern_w is not None:
        assert torch.equal(kern_w, ref_w)
        assert _err(kern_y, ref_y) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zeros_in_the_scales_dtype_give_the_fp32_zeros_bits(dtype: torch.dtype) -> None:
    """Zero points in the scales' dtype (``int_cuda``'s ``kmajor`` storage): the integer
    codes are exact there and the kernels read them as fp32 -- the GEMV and the
    dequantise give the bits of fp32 zeros.  Another dtype is rejected."""
    n, k, m = 40, 256, 3
    (qt, st, zt), _ = _weight(n, k, 128, True, 15, dtype)
    low = zt.to(dtype)  # type: ignore[union-attr]
    x = _x(m, k, 16, dtype).to(DEVICE)
    cfg = (4, 32, 128, 2, 4, 1)
    assert torch.equal(km.kmajor_gemv(x, qt, st, low, 128, config=cfg),
                       km.kmajor_gemv(x, qt, st, zt, 128, config=cfg))
    out = torch.empty(n, k, dtype=dtype, device=DEVICE)
    assert torch.equal(km.kmajor_dequantize(qt, st, low, 128, out.clone()),
                       km.kmajor_dequantize(qt, st, zt, 128, out))
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="zeros_t"):
        km.kmajor_gemv(x, qt, st, zt.to(other), 128)  # type: ignore[union-attr]


def test_rejects_what_the_kernels_cannot_take() -> None:
    n, k = 16, 256
    args, _ = _weight(n, k, 128, False, 0)
    x = _x(9, k, 0).to(DEVICE)
    with pytest.raises(ValueError, match="at most 8 rows"):
        km.kmajor_gemv(x, *args, 128)
    with pytest.raises(ValueError, match="block_m"):
        km.kmajor_gemv(x[:3], *args, 128, config=(2, 32, 128, 1, 4, 1))
    with pytest.raises(ValueError, match="block_k"):
        km.kmajor_gemv(x[:3], *args, 128, config=(4, 32, 512, 1, 4, 1))  # > K
    with pytest.raises(ValueError, match="block_k"):  # the dequantise: within one group
        km.kmajor_dequantize(*args, 128, torch.empty(n, k, device=DEVICE),
                             config=(16, 256, 4))
    with pytest.raises(ValueError, match="group_size"):
        km.kmajor_gemv(x[:3], *args, 64)
    with pytest.raises(ValueError, match="out"):
        km.kmajor_dequantize(*args, 128, torch.empty(k, n, device=DEVICE))


def test_config_priors(tmp_path, monkeypatch) -> None:
    """Block rows cover M; block_k divides K and the group; split-K whole steps <= 16.
    An empty table is pinned: on a GPU with a shipped table its entries would answer."""
    empty = tmp_path / "empty.json"
    empty.write_text('{"configs": []}')
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", str(empty))
    _clear_tables()
    try:
        for m in range(1, 9):
            for n, k, g in [(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 4096),
                            (4096, 4096, -1), (256, 384, 128)]:
                cfg = km.kmajor_config(m, n, k, torch.device("cpu"))
                bm, bn, bk, split = cfg[:4]
                assert bm >= m and bm in (1, 2, 4, 8)
                assert (k if g == -1 else g) % bk == 0 and k % bk == 0
                assert 1 <= split <= min(16, k // bk)
                km._check_config(cfg, m, k, k if g == -1 else g)  # what kmajor_gemv checks
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS")
        _clear_tables()


_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import torch
    from tests.kernels.sm90_compile import (compile_sm90, pdl_trigger_follows_loads,
                                            sass_loops)
    from pagedllm.kernels import wna16_kmajor as km

    out = []
    for m, n, k, split in json.loads(sys.argv[1]):
        bm, bn, bk, _, warps, stages, ahead = km.kmajor_config(m, n, k,
                                                               torch.device("cpu"))
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*fp32",
               "out_ptr": "*fp32" if split else "*bf16"}
        for a in ("M", "N", "stride_xm", "stride_om", "stride_os"):
            sig[a] = "i32"
        k_chunk = k // 4 if split else k
        consts = dict(K=k, GROUP=128, HAS_ZERO=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      K_CHUNK=k_chunk, EVEN_N=True, AHEAD=bool(ahead), WHILE_LOOP=False,
                      USE_PDL=True)
        div = [i for i, a in enumerate(sig) if a != "M"]
        kern, st = compile_sm90(km._kmajor_gemv_kernel, sig, consts,
                                {"num_warps": warps, "num_stages": stages}, div)
        st["convert_layout"] = kern.asm["ttgir"].count("convert_layout")
        st["trigger_last"] = pdl_trigger_follows_loads(kern.asm["ptx"])
        ops = sass_loops(kern.asm["cubin"])[0]["ops"]  # the K loop comes first
        st["loop_shared_ops"] = sum(ops.get(op, 0) for op in ("STS", "LDS", "BAR"))
        out.append({"m": m, "block_m": bm, **st})
    sig = {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*fp32", "out_ptr": "*bf16",
           "N": "i32", "stride_qw": "i32", "stride_s": "i32", "stride_z": "i32",
           "stride_on": "i32"}
    consts = dict(K=4096, GROUP=128, HAS_ZERO=True, BLOCK_N=64, BLOCK_K=128,
                  ROUND_BY_HAND=False, USE_PDL=True)
    kern, st = compile_sm90(km._kmajor_dequant_kernel, sig, consts, {"num_warps": 4},
                            list(range(9)))
    st["convert_layout"] = kern.asm["ttgir"].count("convert_layout")
    out.append({"m": 0, "block_m": 0, "loop_shared_ops": 0, "trigger_last": True, **st})
    print(json.dumps(out))
""")


def test_kernels_compile_for_sm90_without_spills_or_layout_conversions(tmp_path) -> None:
    """The priors (with the register prefetch) at M = 1, 2, 4, 8 (split partials at 4
    and 8, zero points) and the dequantise kernel's default: no spills, and no
    shared-memory traffic in the K loop (the scales and zero points are loaded in the
    words' layout: ``_group``; the stored rows convert once a row each; the dequantise
    kernel has none)."""
    cases = [(1, 4096, 4096, False), (2, 6144, 4096, False), (4, 4096, 14336, True),
             (8, 28672, 4096, True)]
    results = run_script(_SCRIPT, tmp_path, json.dumps(cases))
    assert [r["m"] for r in results] == [1, 2, 4, 8, 0]
    for r in results:
        assert r["spill_stores"] == 0, r
        assert 0 < r["registers"] <= 255, r
        assert r["loop_shared_ops"] == 0, r
        assert r["convert_layout"] <= 2 * r["block_m"] + 1, r
    # The GEMV triggers PDL after its last load: triggered first, it ran Llama-3-8B's
    # zero-point W4 at TPOT 6.50 ms against 4.17 (H100, 2026-12-06; kernels/pdl.py).
    assert all(r["trigger_last"] for r in results), results
    # One row with zero points: 72 registers with triton 3.6, the symmetric loop's 64
    # and one tile of zero points (prefetched with the words it took 96; folded into
    # the unpacking FMA, 126: half the programs an SM holds).
    assert results[0]["registers"] <= 80, results[0]


def _clear_tables() -> None:
    km.tuned_table.cache_clear()
    km.kmajor_config.cache_clear()


@pytest.fixture
def sweep(monkeypatch):
    """``benchmarks/wna16_kmajor_sweep.py`` as a module (dropped again afterwards)."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    monkeypatch.syspath_prepend(os.path.abspath(bench))
    yield importlib.import_module("wna16_kmajor_sweep")
    sys.modules.pop("wna16_kmajor_sweep", None)


def test_tuned_table_overrides_the_priors(tmp_path, monkeypatch, sweep) -> None:
    """``PAGEDLLM_WNA16_KMAJOR_CONFIGS`` in the format the sweep's ``--table`` writes
    (``table_of``): the entry of the smallest swept M >= M at (N, K) whose block_m holds
    the rows wins and runs exactly; other shapes keep the priors."""
    monkeypatch.setitem(sweep.PROJ, "tiny", (256, 512))
    rows = [{"proj": "tiny", "m": 1, "kmajor_best": (1, 32, 256, 2, 4, 1, 0)},
            {"proj": "tiny", "m": 4, "kmajor_best": (4, 64, 128, 1, 4, 1, 1)},
            {"proj": "tiny", "m": 8, "kmajor_best": None}]  # nothing timed in budget
    path = tmp_path / "t.json"
    path.write_text(json.dumps(sweep.table_of(rows)))
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", str(path))
    _clear_tables()
    try:
        cpu = torch.device("cpu")
        assert km.kmajor_config(1, 256, 512, cpu) == (1, 32, 256, 2, 4, 1, 0)
        assert km.kmajor_config(2, 256, 512, cpu) == (4, 64, 128, 1, 4, 1, 1)
        assert km.kmajor_config(8, 256, 512, cpu)[0] == 8  # no entry >= 8: priors
        assert km.kmajor_config(1, 512, 512, cpu)[1:3] == (128, 64)  # other shape: priors
        (qt, st, zt), _ = _weight(256, 512, 128, True, seed=31)
        for m in (1, 3):
            x = _x(m, 512, seed=m)
            got = km.kmajor_gemv(x.to(DEVICE), qt, st, zt, 128)  # the table's config
            ref = w4a16_tc_ref(x, qt.cpu(), st.cpu(), zt.cpu(), 128)
            assert _err(got, ref) <= 1e-5
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS")
        _clear_tables()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(
    os.path.dirname(km.__file__), "tuned", "wna16_kmajor_*.json"))))
def test_shipped_tables_load(path, monkeypatch) -> None:
    """Every shipped ``wna16_kmajor_<GPU>.json`` passes ``tuned_table``'s checks, and
    each entry's block_m holds its row count (so ``kmajor_config`` takes it)."""
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", path)
    _clear_tables()
    try:
        table = km.tuned_table()
        assert table
        assert all(cfg[0] >= m for (m, _, _), cfg in table.items())
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS")
        _clear_tables()


def test_sweep_step_totals_leave_out_kernels_not_timed_everywhere(sweep) -> None:
    """The sweep's per-step sums cover a kernel only where it was timed at every
    projection: a budget that ran out after the first projection must not make the
    K-major GEMV look 10x faster than the baselines timed at all four."""
    rows = [{"proj": name, "m": 1, "stripe_us": 10.0,
             "kmajor_best_us": 8.0 if name == "qkv_proj" else None} for name in sweep.PROJ]
    rows.append({"dequant": {"proj": "qkv_proj"}})
    totals = sweep.step_totals(rows)
    assert totals["1"] == {"stripe_us": pytest.approx(10.0 * len(sweep.PROJ) * 32 / 1000)}
    assert totals["2"] == {}


def test_tuned_table_entry_the_gemv_cannot_take_names_the_variable(tmp_path,
                                                                    monkeypatch) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"configs": [[4, 256, 512, [2, 64, 128, 1, 4, 1, 1]]]}))
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", str(path))
    _clear_tables()
    try:
        with pytest.raises(ValueError, match="PAGEDLLM_WNA16_KMAJOR_CONFIGS.*M=4"):
            km.kmajor_config(1, 256, 512, torch.device("cpu"))
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS")
        _clear_tables()


def test_sweep_dequant_mm_totals_sum_complete_row_counts(sweep) -> None:
    """The dequantise + cuBLAS sums (whole layers, bf16): per row count, only where every
    projection was timed (a sweep whose budget ran out before the last is left out)."""
    rows = [{"dequant_mm": {"proj": name, "m": 256, "bf16_us": 5.0, "whole_us": 9.0}}
            for name in sweep.PROJ]
    rows += [{"dequant_mm": {"proj": name, "m": 1024, "bf16_us": 20.0, "whole_us": 30.0}}
             for name in list(sweep.PROJ)[:-1]]  # the last projection missing
    rows.append({"proj": "qkv_proj", "m": 1, "stripe_us": 1.0})  # a GEMV row: ignored
    totals = sweep.dequant_mm_totals(rows)
    n = len(sweep.PROJ) * 32 / 1000
    assert totals["256"] == {"bf16_us": pytest.approx(5.0 * n),
                             "whole_us": pytest.approx(9.0 * n)}
    assert totals["1024"] == {}
