"""The W4A16 tensor-core GEMM (``kernels/wna16_tc.py``), its K-major layout, its launch
table (``kernels/wna16_tc_config.py``) and the CUDA layer routing that picks it
(``layers/quantization/int_cuda.py``), against the torch references.

Interpreter cases (``TRITON_INTERPRET=1`` without a GPU): symmetric and with zero
points, group 128 / 256 / channel-wise, rows as wgmma's N (``swap``) or M, the scale
before or after the dot, split-K, ragged M and N.  Bounds: fp32 activations and scales
against the fp32 reference: ``1e-5`` of the output's max (fp32 accumulation order; the
interpreter runs the dot in fp32); bf16 activations: ``2**-7`` (the interpreter
truncates to bf16 instead of rounding, output and weight).  Without a GPU the sm_90
compile test checks that the priors and a few other configurations build with no
register spills, on wgmma, and that the packed-half PTX unpack shortens the main loop
(ptxas checks its syntax); its arithmetic is checked on the GPU (``-m gpu``: the same
bits as the fp32 unpack) and by ``benchmarks/wna16_tc_sweep.py``'s checks."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from kernel_refs import DEVICE

from pagedllm.kernels.wna16 import pack_codes, unpack_codes, wna16_ref
from pagedllm.kernels.wna16_tc import from_kmajor, tc_applies, to_kmajor, w4a16_tc_gemm
from pagedllm.layers.quantization.int_layout import IntWeight
from tests.kernels.sm90_compile import run_script


def _weight(n: int, k: int, group: int, zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, groups, generator=g) + 0.5) / k ** 0.5
    zp = torch.randint(0, 16, (n, groups), generator=g).float() if zeros else None
    return pack_codes(codes, 4), scales, zp


def _tc_args(qw: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor | None):
    return (to_kmajor(qw).to(DEVICE), sc.t().contiguous().to(DEVICE),
            None if zp is None else zp.t().contiguous().to(DEVICE))


def test_kmajor_layout_words_hold_eight_consecutive_inputs_of_a_column() -> None:
    qw, _, _ = _weight(5, 256, 128, False, 0)
    codes = unpack_codes(qw, 4)
    t = to_kmajor(qw)
    assert t.shape == (32, 5) and torch.equal(from_kmajor(t), qw)
    for s in range(8):
        assert torch.equal((t >> (4 * s)) & 0xF, codes[:, s::8].t())
    assert tc_applies(4, 256, 128, False) and tc_applies(4, 256, 256, False)
    assert not tc_applies(8, 256, 128, False) and not tc_applies(4, 256, 128, True)
    assert not tc_applies(4, 256, 64, False) and not tc_applies(4, 200, 200, False)


# (block_m, block_n, block_k, group_m, warps, stages, split, swap, scale_after)
CONFIGS = [(16, 32, 64, 1, 4, 2, 1, 1, 0), (16, 32, 128, 1, 4, 2, 2, 1, 1),
           (32, 16, 64, 2, 4, 2, 3, 0, 0), (16, 32, 64, 2, 4, 2, 1, 0, 1)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("group", [128, 256])
def test_tc_gemm_matches_reference_fp32(cfg: tuple[int, ...], zeros: bool,
                                        group: int) -> None:
    """Ragged M (37 rows over 16/32-row tiles) and N (48 columns over 32: the clamped
    column loads), split-K with a ragged last chunk (3 over 4 steps)."""
    n, k, m = 48, 256, 37
    qw, sc, zp = _weight(n, k, group, zeros, 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    got = w4a16_tc_gemm(x.to(DEVICE), *_tc_args(qw, sc, zp), group, config=cfg).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, 4, group)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_even_split_never_leaves_a_short_last_chunk() -> None:
    """The K loop has no bound check: every split must cover exactly ``K_CHUNK`` inputs
    (``int8_gemm.split_k_chunk`` would give 4096 / 128 steps over 5 splits a last chunk
    of 512 < 896: reads past K, nan / illegal address on the H200)."""
    from pagedllm.kernels.wna16_tc import even_split

    assert even_split(4096, 128, 5) == (1024, 4)
    assert even_split(640, 128, 2) == (640, 1)
    for k in (256, 640, 4096, 14336):
        for bk in (64, 128):
            for split in range(1, 20):
                chunk, s = even_split(k, bk, split)
                assert chunk * s == k and chunk % bk == 0 and 1 <= s <= split


def test_tc_gemm_split_that_does_not_divide_the_steps() -> None:
    """5 K steps asked to split 2 ways (the qkv prior's case in small)."""
    n, k, m = 32, 640, 16
    qw, sc, zp = _weight(n, k, 128, True, 11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12))
    cfg = (16, 32, 128, 1, 4, 2, 2, 1, 0)
    got = w4a16_tc_gemm(x.to(DEVICE), *_tc_args(qw, sc, zp), 128, config=cfg).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, 4, 128)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_tc_gemm_channelwise_and_priors() -> None:
    """Channel-wise scales (G = K) with the priors' configuration (no table on CPU)."""
    n, k = 40, 384
    qw, sc, zp = _weight(n, k, k, True, 3)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(4))
    got = w4a16_tc_gemm(x.to(DEVICE), *_tc_args(qw, sc, zp), -1).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, 4, k)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("after", [0, 1])
def test_tc_gemm_bf16(after: int) -> None:
    n, k = 32, 256
    qw, sc, _ = _weight(n, k, 128, False, 5)
    sc = sc.to(torch.bfloat16)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    cfg = (16, 32, 128, 1, 4, 2, 1, 1, after)
    got = w4a16_tc_gemm(x.to(DEVICE), *_tc_args(qw, sc, None), 128, config=cfg).cpu()
    assert got.dtype == torch.bfloat16
    ref = wna16_ref(x.float(), qw, sc, None, None, 4, 128)
    assert float((got.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())


@pytest.mark.parametrize("after", [0, 1])
def test_tc_gemm_bf16_zeros_give_the_fp32_zeros_bits(after: int) -> None:
    """Zero points in the scales' dtype (bf16; ``int_cuda``'s ``kmajor`` storage) are
    read as fp32: the bits of fp32 zeros.  Integer zeros are rejected."""
    n, k = 32, 256
    qw, sc, zp = _weight(n, k, 128, True, 7)
    qt, st, zt = _tc_args(qw, sc.to(torch.bfloat16), zp)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.to(DEVICE)
    cfg = (16, 32, 128, 1, 4, 2, 1, 1, after)
    got = w4a16_tc_gemm(x, qt, st, zt.to(torch.bfloat16), 128, config=cfg)  # type: ignore
    assert torch.equal(got, w4a16_tc_gemm(x, qt, st, zt, 128, config=cfg))
    with pytest.raises(ValueError, match="zeros_t"):
        w4a16_tc_gemm(x, qt, st, zt.int(), 128, config=cfg)  # type: ignore[union-attr]


def test_tc_gemm_rejects_unsupported_groups() -> None:
    qw, sc, _ = _weight(8, 256, 64, False, 0)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_tc_gemm(torch.randn(16, 256), to_kmajor(qw), sc.t().contiguous(), None, 64)


def _use_table(monkeypatch, path, configs: list) -> None:
    """Point ``PAGEDLLM_WNA16_TC_CONFIGS`` at a table holding ``configs``."""

    path.write_text(json.dumps({"configs": configs, "summary": {}}))
    monkeypatch.setenv("PAGEDLLM_WNA16_TC_CONFIGS", str(path))
    _clear_tables()


def _clear_tables() -> None:
    from pagedllm.kernels import wna16_tc_config as tcc

    tcc._tuned_file.cache_clear()
    tcc._table.cache_clear()
    tcc.tc_choice.cache_clear()


@pytest.fixture
def clean_tables():
    _clear_tables()
    yield
    _clear_tables()


def test_act_order_layer_routes_rows_by_count(tmp_path, monkeypatch, clean_tables) -> None:
    """GPTQ act-order, symmetric (the K-major copy stored with zero = 8; weights with zero
    points keep the K-major layout alone: tests/kernels/test_int4_kmajor_layer.py), through
    the CUDA layer storage: inputs permuted at load, the K-major copy made from the permuted
    weight; with a table entry 20 rows (>= TC_MIN_M) take the tensor-core GEMM, 3 rows
    the striped kernel; both equal ``x @ w^T``."""
    from pagedllm.kernels import wna16_kmajor
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import _tc_route, apply_cuda, store_cuda

    # the striped storage under test, whatever K-major table this GPU ships
    monkeypatch.setattr(wna16_kmajor, "has_table", lambda: False)
    n, k, g = 32, 256, 128
    _use_table(monkeypatch, tmp_path / "t.json",
               [[64, n, k, "tc", [16, 32, 128, 1, 4, 2, 1, 1, 0]]])
    qw, sc, zp = _weight(n, k, g, False, 7)
    gen = torch.Generator().manual_seed(8)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // g).to(torch.int32)
    iw = IntWeight(qw, sc, zp, g_idx, 4, g)
    with torch.device(DEVICE):
        layer = ReplicatedLinear(k, n, bias=False, prefix="x")
    layer.register_buffer("int_perm", None, persistent=False)
    store_cuda(layer, IntWeight(qw.to(DEVICE), sc.to(DEVICE),
                                None if zp is None else zp.to(DEVICE),
                                g_idx.to(DEVICE), 4, g), torch.float32)
    assert layer.int_layout == "stripe" and layer.int_tc_qweight is not None
    assert layer.int_tc_zeros is not None  # symmetric: zero = 8, the one shipped path
    if zp is None:
        assert bool((layer.int_tc_zeros == 8.0).all())
    perm = layer.int_perm.cpu()
    assert torch.equal(from_kmajor(layer.int_tc_qweight.cpu()),
                       pack_codes(unpack_codes(qw, 4)[:, perm], 4))
    ref_w = iw.dequantize(torch.float32)
    dev = torch.device(DEVICE)
    for m in (20, 3):
        route = _tc_route(layer, m, n, k, dev)
        assert (route is not None and route[0] == "tc") == (m >= 16)
        x = torch.randn(m, k, generator=gen)
        got = apply_cuda(layer, x.to(DEVICE)).cpu()
        ref = x @ ref_w.T
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_no_table_means_no_kmajor_copy_and_no_unchecked_route(tmp_path, monkeypatch,
                                                              clean_tables) -> None:
    """Only GPU-checked (table) configurations are routed to: without a table the kernel
    is off; with one, shapes it lacks stay on the striped kernels."""
    from pagedllm.kernels import wna16_tc_config as tcc
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import _tc_route, store_cuda

    monkeypatch.delenv("PAGEDLLM_WNA16_TC_CONFIGS", raising=False)
    _clear_tables()
    n, k = 16, 256
    qw, sc, _ = _weight(n, k, 128, False, 9)
    if not tcc.has_table():  # a GPU host may ship one
        assert tcc.tc_min_m() == 0
        with torch.device(DEVICE):
            layer = ReplicatedLinear(k, n, bias=False, prefix="x")
        store_cuda(layer, IntWeight(qw.to(DEVICE), sc.to(DEVICE), None, None, 4, 128),
                   torch.float32)
        assert layer.int_tc_qweight is None
    _use_table(monkeypatch, tmp_path / "t.json",
               [[64, 999, k, "tc", [16, 32, 128, 1, 4, 2, 1, 1, 0]]])
    with torch.device(DEVICE):
        layer = ReplicatedLinear(k, n, bias=False, prefix="x")
    store_cuda(layer, IntWeight(qw.to(DEVICE), sc.to(DEVICE), None, None, 4, 128),
               torch.float32)
    assert layer.int_tc_qweight is not None
    assert _tc_route(layer, 32, n, k, torch.device(DEVICE)) is None  # (16, 256): a prior


def test_tc_off_and_w8_keep_no_kmajor_copy(monkeypatch) -> None:
    from pagedllm.kernels import wna16_kmajor
    from pagedllm.kernels import wna16_tc_config as tcc
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import store_cuda

    n, k = 16, 256
    qw, sc, _ = _weight(n, k, 128, False, 9)
    monkeypatch.setattr(tcc, "tc_min_m", lambda: 0)  # a table with tc_min_m 0, or none
    monkeypatch.setattr(wna16_kmajor, "has_table", lambda: False)  # nor a K-major one
    with torch.device(DEVICE):
        layer = ReplicatedLinear(k, n, bias=False, prefix="x")
    store_cuda(layer, IntWeight(qw.to(DEVICE), sc.to(DEVICE), None, None, 4, 128),
               torch.float32)
    assert layer.int_layout == "stripe" and layer.int_tc_qweight is None


def test_tuned_table_routes_by_rows(tmp_path, monkeypatch) -> None:
    """``PAGEDLLM_WNA16_TC_CONFIGS`` (the sweep's ``--table``): the entry of the smallest
    swept M >= M at (N, K) wins (the largest above), ``dequant`` entries leave the GEMM
    (when the dequantise scratch can exist), unknown shapes get ``prior``, and the summary
    sets ``tc_min_m``."""
    from pagedllm.kernels import wna16_tc_config as tcc

    def clear() -> None:
        tcc._tuned_file.cache_clear()
        tcc._table.cache_clear()
        tcc.tc_choice.cache_clear()

    a = [16, 64, 128, 1, 4, 4, 2, 1, 0]
    b = [128, 128, 128, 8, 8, 3, 1, 0, 0]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": [[64, 64, 256, "tc", a],
                                            [256, 64, 256, "tc", b],
                                            [2048, 64, 256, "dequant", None]],
                                "summary": {"tc_min_m": 32}}))
    monkeypatch.setenv("PAGEDLLM_WNA16_TC_CONFIGS", str(path))
    clear()
    try:
        cpu = torch.device("cpu")
        assert tcc.tc_choice(17, 64, 256, cpu) == ("tc", tuple(a))
        assert tcc.tc_choice(65, 64, 256, cpu) == ("tc", tuple(b))
        assert tcc.tc_choice(300, 64, 256, cpu) == ("dequant", None)
        assert tcc.tc_choice(9000, 64, 256, cpu) == ("dequant", None)
        assert tcc.tc_choice(17, 128, 256, cpu)[0] == "prior"
        assert tcc.tc_config(300, 64, 256, cpu) == tcc.prior_config(300, 64, 256, cpu)
        assert tcc.tc_min_m() == 32
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_TC_CONFIGS")
        clear()


LLAMA3_8B = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
             "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("proj", list(LLAMA3_8B))
def test_gpu_default_routing_llama3_8b(proj: str, zeros: bool) -> None:
    """What a W4A16 Llama-3-8B layer runs by default (``int_cuda.apply_cuda``: the tuned
    table if present -- ``PAGEDLLM_WNA16_TC_CONFIGS`` or the shipped one -- else the
    striped / dequantise paths), at M = 1, 16, 64, 100 (ragged: between table rows),
    256, 2048, symmetric and with zero points, against the dequantised weight's fp32
    product.  Twice per M: the same bits
    (a race or a read of uninitialised memory shows as a difference)."""
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import _tc_route, apply_cuda, store_cuda

    n, k = LLAMA3_8B[proj]
    qw, sc, zp = _weight(n, k, 128, zeros, n + k)
    sc = sc.to(torch.bfloat16)
    iw = IntWeight(qw.cuda(), sc.cuda(), None if zp is None else zp.cuda(), None, 4, 128)
    with torch.device("cuda"):
        layer = ReplicatedLinear(k, n, bias=False, prefix=proj)
    store_cuda(layer, iw, torch.bfloat16)
    ref_w = iw.dequantize(torch.float32)
    for m in (1, 16, 64, 100, 256, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        route = _tc_route(layer, m, n, k, x.device)
        got = apply_cuda(layer, x)
        again = apply_cuda(layer, x)
        ref = x.float() @ ref_w.T
        err = float((got.float() - ref).abs().max()) / float(ref.abs().max())
        # bf16 output rounding (2**-8 relative) plus fp32 accumulation-order differences
        assert err <= 2 ** -7, (proj, m, zeros, route, err)
        assert torch.equal(got, again), (proj, m, zeros, route)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64, 256, 2048])
def test_gpu_tc_gemm_llama3_shapes(n: int, k: int, m: int, monkeypatch) -> None:
    """Real shapes with the priors, zero points."""
    qw, sc, zp = _weight(n, k, 128, True, m)
    qw, sc, zp = qw.cuda(), sc.to(torch.bfloat16).cuda(), zp.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = w4a16_tc_gemm(x, to_kmajor(qw), sc.t().contiguous(), zp.t().contiguous(), 128)
    ref = wna16_ref(x.float(), qw, sc, zp, None, 4, 128)
    # bf16 output rounding (2**-8 relative) plus fp32 accumulation-order differences
    assert float((got.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("cfg", [(16, 128, 128, 1, 4, 4, 8, 1, 0),
                                 (64, 128, 128, 4, 4, 3, 4, 1, 0),
                                 (128, 256, 128, 8, 8, 3, 1, 1, 0),
                                 (256, 128, 128, 8, 8, 3, 1, 1, 0),
                                 (64, 128, 128, 4, 4, 3, 1, 0, 0)])
def test_gpu_packed_unpack_gives_the_fp32_unpack_bits(zeros: bool, cfg: tuple[int, ...],
                                                      monkeypatch) -> None:
    """The packed-half PTX unpack (``wna16_tc.packed_unpack_applies``) against the fp32
    unpack of the same configuration: the same weight tile, so the same bits, at 100
    rows (ragged) of a Llama-3-8B down_proj, with and without zero points (bf16, as
    ``int_cuda`` stores them)."""
    from pagedllm.kernels import wna16_tc

    dtype = torch.bfloat16
    n, k = 4096, 14336
    qw, sc, zp = _weight(n, k, 128, zeros, 7)
    qt, st, zt = _tc_args(qw.cuda(), sc.to(dtype).cuda(), None if zp is None else zp.cuda())
    zt = None if zt is None else zt.to(dtype)
    x = torch.randn(100, k, device="cuda", dtype=dtype)
    assert wna16_tc.packed_unpack_applies(x, st, zt, cfg[2], bool(cfg[8]))
    got = w4a16_tc_gemm(x, qt, st, zt, 128, config=cfg)
    again = w4a16_tc_gemm(x, qt, st, zt, 128, config=cfg)
    monkeypatch.setattr(wna16_tc, "packed_unpack_applies", lambda *a: False)
    want = w4a16_tc_gemm(x, qt, st, zt, 128, config=cfg)
    assert torch.equal(got, again) and torch.equal(got, want)


_SCRIPT = textwrap.dedent(r"""
    import json, re, sys
    import torch
    from tests.kernels.sm90_compile import compile_sm90, sass_loops
    from pagedllm.kernels import wna16_tc as tc
    from pagedllm.kernels.wna16_tc_config import prior_config

    H200 = torch.device("cpu")  # block shapes only; the split is set below
    out = []
    for name, m, n, k, zeros, split, cfg, packed in json.loads(sys.argv[1]):
        if cfg is None:
            p = prior_config(m, n, k, H200)
            cfg = list(p[:6]) + list(p[7:])  # without the split (set below)
        bm, bn, bk, gm, warps, stages, swap, after = cfg
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16",
               "z_ptr": "*fp32" if zeros and not packed else "*bf16",
               "out_ptr": "*fp32" if split else "*bf16"}
        for a in ("M", "N", "stride_xm", "stride_om", "stride_os"):
            sig[a] = "i32"
        consts = dict(K=k, GROUP=128, HAS_ZERO=zeros, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      GROUP_M=gm, K_CHUNK=k // 4 if split else k, SWAP=bool(swap),
                      SCALE_AFTER=bool(after), IEEE=False, EVEN_N=True, USE_PDL=True,
                      PACKED=packed)
        div = [i for i, a in enumerate(sig) if a != "M"]
        kern, st = compile_sm90(tc._w4a16_tc_kernel, sig, consts,
                                {"num_warps": warps, "num_stages": stages}, div)
        st["wgmma"] = kern.asm["ttgir"].count("warp_group_dot ")
        # in-loop waits that leave wgmmas in flight (dequantisation overlaps the MMA)
        st["async_waits"] = len(re.findall(r"wgmma.wait_group.sync.aligned [1-9]",
                                           kern.asm["ptx"]))
        loops = sass_loops(kern.asm["cubin"])
        st["loop"] = max(loops, key=lambda lp: lp["instructions"]) if loops else None
        out.append({"name": name, **st})
    print(json.dumps(out))
""")

# (name, M, N, K, zeros, split-K, config or None = the priors, packed unpack): the priors
# of each row bucket at the 8B shapes, zero points, split partials.
CASES = [
    ("prior o_proj M=16 split", 16, 4096, 4096, False, True, None, True),
    ("prior down M=64 zeros", 64, 4096, 14336, True, False, None, True),
    ("prior gate_up M=2048", 2048, 28672, 4096, False, False, None, True),
    ("scale after M=16", 16, 6144, 4096, False, True, [16, 128, 128, 1, 4, 4, 1, 1], False),
    ("B operand M=256 zeros", 256, 6144, 4096, True, False, [128, 256, 64, 8, 8, 3, 0, 0],
     True),
    ("swap M=2048 zeros", 2048, 4096, 14336, True, False, [256, 128, 64, 8, 8, 3, 1, 0],
     True),
    # the H100 table's tile from 256 rows up (wgmma N = 256, 248 registers)
    ("table M=1024 gate_up", 1024, 28672, 4096, False, False, [256, 128, 128, 8, 8, 3, 1, 0],
     True),
    # the fp32 unpack (fp32 zero points) of the table's 256-row gate_up configuration,
    # against the packed-half unpack of the same configuration
    ("fp32 unpack M=256 zeros", 256, 28672, 4096, True, False, [128, 256, 128, 8, 8, 3, 1, 0],
     False),
    ("packed unpack M=256 zeros", 256, 28672, 4096, True, False, [128, 256, 128, 8, 8, 3, 1, 0],
     True),
]


def test_tc_kernel_compiles_for_sm90_on_wgmma_without_spills(tmp_path) -> None:
    results = run_script(_SCRIPT, tmp_path, json.dumps(CASES))
    assert [r["name"] for r in results] == [c[0] for c in CASES]
    for r in results:
        assert r["spill_stores"] == 0, r
        assert 0 < r["registers"] <= 255, r
        assert r["wgmma"] >= 1, r  # Hopper's warp-group MMA, not mma.sync
        assert r["shared"] <= 232448, r  # an H100/H200 block's shared memory
        if r["name"].startswith("prior"):
            assert r["async_waits"] >= 1, r
    # The packed-half unpack (two codes per LOP3, HADD2 / HMUL2 on pairs) leaves no fp32
    # multiply in the main loop and takes about a third fewer instructions there.
    fp32, packed = results[-2]["loop"], results[-1]["loop"]
    assert packed["ops"].get("HMUL2", 0) > 0 and packed["ops"].get("FMUL", 0) == 0, packed
    assert packed["instructions"] < 0.75 * fp32["instructions"], (fp32, packed)
