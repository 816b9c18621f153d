"""The single-copy K-major storage of the 4-bit CUDA layers with zero points, and of
symmetric ones where a K-major GEMV table exists (``layers/quantization/int_cuda.py``;
without one symmetric layers keep the striped layout): what is stored, what the start-up
log counts, and
that every row count's route (the K-major GEMV, the tensor-core GEMM with a table or
prior configuration, dequantise + ``F.linear``) equals the dequantised weight's product.

Layers are built through ``store_cuda`` on CPU tensors under ``TRITON_INTERPRET=1`` (or on
the GPU), N = K = 256, group 128, symmetric and with zero points.  A tuned tensor-core
table (``PAGEDLLM_WNA16_TC_CONFIGS``) is written per test so the routes do not depend on
the host.  Bounds: fp32 against the fp32 reference, ``1e-5`` of the output's max
(accumulation order); bf16 ``2**-6`` (the interpreter truncates to bf16 instead of
rounding, the tensor-core kernel's weight tile and every output: up to 2**-7 each)."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_refs import DEVICE

from pagedllm.kernels.wna16 import pack_codes
from pagedllm.kernels.wna16_tc import from_kmajor
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import int_cuda
from pagedllm.layers.quantization.int_layout import IntWeight

N, K, G = 256, 256, 128
CFG16 = [16, 64, 128, 1, 4, 2, 2, 1, 0]  # swap, split-K 2
CFG64 = [32, 128, 64, 2, 4, 2, 1, 0, 1]  # no swap, scale after the dot
TABLE = [[16, N, K, "tc", CFG16], [64, N, K, "tc", CFG64], [2048, N, K, "dequant", None]]


def _clear_tables() -> None:
    from pagedllm.kernels import wna16_kmajor as km
    from pagedllm.kernels import wna16_tc_config as tcc

    tcc._tuned_file.cache_clear()
    tcc._table.cache_clear()
    tcc.tc_choice.cache_clear()
    km.tuned_table.cache_clear()
    km.kmajor_config.cache_clear()


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A tensor-core table for (N, K), and an empty K-major GEMV table (so a GPU's
    shipped one does not decide the symmetric layers' storage)."""
    path = tmp_path / "wna16_tc.json"
    path.write_text(json.dumps({"configs": TABLE, "summary": {"tc_min_m": 16}}))
    no_kmajor = tmp_path / "no_kmajor.json"
    no_kmajor.write_text(json.dumps({"configs": []}))
    monkeypatch.setenv("PAGEDLLM_WNA16_TC_CONFIGS", str(path))
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", str(no_kmajor))
    monkeypatch.delenv("PAGEDLLM_WNA16_CONFIGS", raising=False)  # dequant_min_m: 512
    _clear_tables()
    yield path
    monkeypatch.delenv("PAGEDLLM_WNA16_TC_CONFIGS")
    monkeypatch.delenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS")
    _clear_tables()


@pytest.fixture
def kmajor_table(table, tmp_path, monkeypatch):
    """Beside the tensor-core table, a K-major GEMV table for (N, K) in the format the
    sweep's ``--table`` writes (as the H100's shipped one); ``table`` clears both."""
    path = tmp_path / "wna16_kmajor.json"
    path.write_text(json.dumps({"configs": [[1, N, K, [1, 64, 128, 1, 4, 1, 0]],
                                            [4, N, K, [4, 64, 128, 1, 4, 1, 1]]]}))
    monkeypatch.setenv("PAGEDLLM_WNA16_KMAJOR_CONFIGS", str(path))
    _clear_tables()
    return path


def _int_weight(zeros: bool, seed: int, dtype: torch.dtype = torch.float32,
                act_order: bool = False, bits: int = 4) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g)
    scales = ((torch.rand(N, K // G, generator=g) + 0.5) / K ** 0.5).to(dtype)
    zp = torch.randint(0, 1 << bits, (N, K // G), generator=g).float() if zeros else None
    g_idx = None
    if act_order:
        g_idx = (torch.argsort(torch.randperm(K, generator=g)) // G).to(torch.int32)
    return IntWeight(pack_codes(codes, bits), scales, zp, g_idx, bits, G)


def _layer(iw: IntWeight, dtype: torch.dtype = torch.float32) -> ReplicatedLinear:
    with torch.device(DEVICE):
        layer = ReplicatedLinear(K, N, bias=False, prefix="x")
    del layer.weight  # as process_weights_after_loading drops the checkpoint's
    layer.register_buffer("int_perm", None, persistent=False)
    dev = [None if t is None else t.to(DEVICE) for t in (iw.qweight, iw.scales, iw.zeros,
                                                         iw.g_idx)]
    int_cuda.store_cuda(layer, IntWeight(*dev, iw.bits, iw.group_size), dtype)  # type: ignore
    return layer


def _check(layer: ReplicatedLinear, iw: IntWeight, m: int, seed: int,
           dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = int_cuda.apply_cuda(layer, x.to(DEVICE)).float().cpu()
    ref = x.float() @ iw.dequantize(torch.float32).T
    bound = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert got.shape == (m, N)
    err = float((got - ref).abs().max()) / float(ref.abs().max())
    assert err <= bound, (m, err)


def _route(layer: ReplicatedLinear, m: int) -> tuple:
    return int_cuda._kmajor_route(layer, m, N, K, torch.device(DEVICE))


def test_zero_points_store_one_kmajor_copy(table) -> None:
    """With zero points: no striped copy; the K-major words are the weight's; the buffers
    take the IntWeight's bytes (codes, scales and zeros in the layer dtype, here fp32) --
    at most 1.05x; the dequantise scratch is reserved."""
    iw = _int_weight(True, 1)
    layer = _layer(iw)
    assert layer.int_layout == "kmajor" and layer.int_qweight is None
    names = dict(layer.named_buffers())
    assert "int_qweight" not in names and "int_tc_qweight" in names
    assert torch.equal(from_kmajor(layer.int_tc_qweight.cpu()), iw.qweight)
    assert layer.int_tc_zeros is not None
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    ckpt = sum(t.numel() * t.element_size()
               for t in (iw.qweight, iw.scales, iw.zeros) if t is not None)
    assert stored <= 1.05 * ckpt, (stored, ckpt)
    assert layer.int_scratch is not None and layer.int_scratch.tensor.numel() >= N * K


def test_symmetric_weights_keep_the_striped_layout(table) -> None:
    """Symmetric: the striped layout, with the K-major copy for the tensor-core GEMM
    where a tuned table exists (the fixture's), and the reference product."""
    iw = _int_weight(False, 1)
    layer = _layer(iw)
    assert layer.int_layout == "stripe" and layer.int_tc_qweight is not None
    for m in (1, 16, 100):
        _check(layer, iw, m, 40 + m)


def test_symmetric_weights_go_kmajor_with_a_kmajor_table(kmajor_table) -> None:
    """With this GPU's K-major GEMV table a symmetric layer is stored as a zero-point one:
    the K-major words alone (no striped copy, no zeros: the kernels' constant 8, at most
    1.02x the packed codes + scales in bf16), and every route equals the reference."""
    iw = _int_weight(False, 14, torch.bfloat16)
    layer = _layer(iw, torch.bfloat16)
    assert layer.int_layout == "kmajor" and layer.int_qweight is None
    assert layer.int_tc_zeros is None
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored <= 1.02 * (N * K // 2 + iw.scales.numel() * 2), stored
    routes = {m: _route(layer, m)[0] for m in (1, 3, 8, 16, 40, 100)}
    assert routes == {1: "gemv", 3: "gemv", 8: "tc", 16: "tc", 40: "tc", 100: "dequant"}
    for m in routes:
        _check(layer, iw, m, 50 + m, torch.bfloat16)


def test_layout_summary_names_what_was_stored(table) -> None:
    """The start-up log's ``int layouts`` part (``loader.load_model`` on CUDA)."""
    layers = [_layer(_int_weight(True, 15)), _layer(_int_weight(True, 16)),
              _layer(_int_weight(False, 17)), _layer(_int_weight(True, 18, bits=8))]
    assert int_cuda.layout_summary([torch.nn.ReLU(), *layers]) == (
        "int layouts: kmajor x2, stripe x1, stripe+tc x1")
    assert int_cuda.layout_summary([torch.nn.ReLU()]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kmajor_zeros_in_the_scales_dtype(dtype: torch.dtype, table) -> None:
    """Zero points are stored in the scales' dtype (the integer codes are exact there):
    a group-128 layer is at most 1.03x its packed codes + scales + 4-bit zeros (fp32
    zeros: 1.053x), and every route (GEMV, tensor-core GEMM, dequantise) gives the bits
    of the same layer with fp32 zeros.  A zero the dtype would round keeps fp32."""
    iw = _int_weight(True, 12, dtype)
    layer = _layer(iw, dtype)
    assert layer.int_tc_zeros.dtype == layer.int_tc_scales.dtype == dtype
    assert torch.equal(layer.int_tc_zeros.float().cpu(), iw.zeros.t())  # type: ignore
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    ckpt = N * K // 2 + iw.scales.numel() * 2 + iw.zeros.numel() // 2  # type: ignore
    assert stored <= 1.03 * ckpt, (stored, ckpt)
    x = torch.randn(100, K, generator=torch.Generator().manual_seed(13)).to(dtype)
    x = x.to(DEVICE)
    low = [int_cuda.apply_cuda(layer, x[:m]) for m in (2, 16, 100)]
    layer.int_tc_zeros = layer.int_tc_zeros.float()
    for m, got in zip((2, 16, 100), low):
        assert torch.equal(got, int_cuda.apply_cuda(layer, x[:m])), m
    iw.zeros[0, 0] = 2.5 + 2 ** -12  # type: ignore[index]  (not exact in bf16/fp16)
    assert _layer(iw, dtype).int_tc_zeros.dtype == torch.float32


def test_start_up_log_counts_the_kmajor_copy_as_the_weight(table) -> None:
    """``loader.weight_bytes``: the unquantised figure is N * K elements for both
    storages (the symmetric layer's K-major copy counts nothing there); the zero-point
    layer's single K-major copy stores about half a byte per weight less."""
    from pagedllm.models.loader import weight_bytes

    kmajor = _layer(_int_weight(True, 2), torch.bfloat16)
    both = _layer(_int_weight(False, 2), torch.bfloat16)
    assert both.int_layout == "stripe" and both.int_tc_qweight is not None
    assert kmajor.int_layout == "kmajor"
    for layer in (kmajor, both):
        assert weight_bytes(layer, as_dtype_bytes=2) == N * K * 2
    codes = N * K // 2
    assert weight_bytes(both) - weight_bytes(kmajor) >= codes - N * (K // G) * 2
    assert weight_bytes(kmajor) <= 1.05 * (codes + N * (K // G) * (2 + 4))


def test_other_layers_keep_todays_storage(table) -> None:
    """Where the tensor-core kernel does not apply (8-bit here) zero points change
    nothing: the striped layout."""
    iw = _int_weight(True, 3, bits=8)
    layer = _layer(iw)
    assert layer.int_layout == "stripe" and layer.int_tc_qweight is None
    _check(layer, iw, 3, 4)


def test_routes_by_rows_match_the_reference(table) -> None:
    """1 and 3 rows: the GEMV; 8: the tensor-core GEMM with the table's 16-row entry
    (rows past M masked); 16 / 40: the table's entries; 100: the table's "dequant"
    (kmajor_dequantize of the whole layer + F.linear)."""
    iw = _int_weight(True, 5)
    layer = _layer(iw)
    expect = {1: ("gemv", None), 3: ("gemv", None), 8: ("tc", tuple(CFG16)),
              16: ("tc", tuple(CFG16)), 40: ("tc", tuple(CFG64)), 100: ("dequant", None)}
    for m, route in expect.items():
        assert _route(layer, m) == route, m
        _check(layer, iw, m, 10 + m)


def test_shapes_without_a_table_entry(table, monkeypatch) -> None:
    """(N, K) absent from the table: the tensor-core priors below ``dequant_min_m``,
    the dequantise path from it; with no scratch (``dequant_min_m`` 0 at load) the
    tensor-core GEMM at any M."""
    from pagedllm.kernels import wna16_tc_config as tcc

    table.write_text(json.dumps({"configs": [[64, 999, K, "tc", CFG16]],
                                 "summary": {"tc_min_m": 16}}))
    _clear_tables()
    iw = _int_weight(True, 6, act_order=True)  # act-order: inputs permuted at load
    layer = _layer(iw)
    assert layer.int_perm is not None and layer.int_layout == "kmajor"
    dev = torch.device(DEVICE)
    monkeypatch.setattr(int_cuda, "dequant_min_m", lambda: 24)
    assert _route(layer, 3) == ("gemv", None)
    assert _route(layer, 20) == ("tc", tcc.prior_config(20, N, K, dev))
    assert _route(layer, 24) == ("dequant", None)
    for m in (3, 20, 24):
        _check(layer, iw, m, 20 + m)
    monkeypatch.setattr(int_cuda, "dequant_min_m", lambda: 0)
    layer = _layer(iw)
    assert layer.int_scratch is None
    assert _route(layer, 3000) == ("tc", tcc.prior_config(3000, N, K, dev))


def test_bf16_gemv_tc_and_dequant(table) -> None:
    iw = _int_weight(True, 8, torch.bfloat16)
    layer = _layer(iw, torch.bfloat16)
    for m in (2, 16, 100):
        _check(layer, iw, m, 30 + m, torch.bfloat16)


def test_kmajor_dequantize_takes_column_slices() -> None:
    """Column slices ``[:, n0:n1]`` (row stride N): exactly the rows ``n0:n1`` of the
    whole weight."""
    from pagedllm.kernels.wna16_kmajor import kmajor_dequantize
    from pagedllm.kernels.wna16_tc import to_kmajor

    iw = _int_weight(True, 9)
    qt = to_kmajor(iw.qweight).to(DEVICE)
    st = iw.scales.t().contiguous().to(DEVICE)
    zt = iw.zeros.t().contiguous().to(DEVICE)  # type: ignore[union-attr]
    whole = iw.dequantize(torch.float32)
    for n0, n1 in ((0, 128), (128, 256), (64, 72)):
        out = torch.full((n1 - n0, K), float("nan"), device=DEVICE)
        got = kmajor_dequantize(qt[:, n0:n1], st[:, n0:n1], zt[:, n0:n1], G, out)
        assert torch.equal(got.cpu(), whole[n0:n1])
    with pytest.raises(ValueError, match="contiguous columns"):
        kmajor_dequantize(qt[:, ::2], st[:, ::2], zt[:, ::2], G,
                          torch.empty(N // 2, K, device=DEVICE))


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_layer_forward(sym: bool, table) -> None:
    """A GPTQ act-order checkpoint layer through its quantisation method (checkpoint
    tensors -> ``store_canonical`` -> ``layer(x)``): K-major only with zero points, the
    striped layout symmetric; both equal the reference."""
    from pagedllm.layers.quantization.gptq import GPTQConfig
    from tests.layers.int_fixtures import pack_gptq

    w = torch.randn(N, K, generator=torch.Generator().manual_seed(11)) * 0.05
    tensors, deq = pack_gptq(w, 4, G, True, sym, seed=3)
    with torch.device(DEVICE):
        layer = ReplicatedLinear(K, N, bias=False, quant_config=GPTQConfig(
            4, G, True, sym, True, []), prefix="x")
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t.to(DEVICE))
    method = layer.quant_method
    iw = method.to_int_weight(layer)
    for name in method.checkpoint_params:
        delattr(layer, name)
    layer.register_buffer("int_perm", None, persistent=False)
    method.store_canonical(layer, iw, torch.float32)
    assert layer.int_layout == ("stripe" if sym else "kmajor")
    assert layer.int_perm is not None
    assert ("int_qweight" in dict(layer.named_buffers())) == sym
    for m in (3, 20):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        y = layer(x.to(DEVICE)).float().cpu()
        ref = x @ deq.T
        assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
