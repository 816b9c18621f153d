"""The striped INT4/INT8 layout and its kernels (``kernels/wna16_stripe.py``), the CUDA
layer storage that picks them (``layers/quantization/int_cuda.py``), and the W8A8
per-token quantiser in compressed-tensors' arithmetic, against their references.

Interpreter cases (``TRITON_INTERPRET=1`` without a GPU): bits 4 and 8, symmetric and
with zero points, group 128 / 256 / channel-wise, the GEMV (M 1 and 3) and the tensor-core
tile (M 17), split-K with a ragged last chunk, the GEMV's register prefetch.  Bounds:
fp32 accumulation against the fp32 reference (the interpreter runs the dot in fp32 too);
the dequantise kernel and the layouts are exact."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE

from pagedllm.kernels.int8_gemm import quant_per_token_int8
from pagedllm.kernels.wna16 import dequantize, pack_codes, unpack_codes, wna16_ref
from pagedllm.kernels.wna16_stripe import (
    from_stripes,
    stripe_dequantize,
    stripe_gemm,
    to_stripes,
)
from pagedllm.layers.quantization.int_layout import IntWeight


def _weight(n: int, k: int, bits: int, group: int, zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = k // (k if group == -1 else group)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = (torch.rand(n, groups, generator=g) + 0.5) / k ** 0.5
    zp = torch.randint(0, 1 << bits, (n, groups), generator=g).float() if zeros else None
    return pack_codes(codes, bits), scales, zp


@pytest.mark.parametrize("bits", [4, 8])
def test_stripe_layout_puts_each_slot_on_a_contiguous_run(bits: int) -> None:
    p, s = 32 // bits, 128 // (32 // bits)
    qw, _, _ = _weight(3, 256, bits, 128, False, 0)
    st = to_stripes(qw, bits)
    assert torch.equal(from_stripes(st, bits), qw)
    codes, words = unpack_codes(qw, bits), unpack_codes(st, bits).reshape(3, -1, p)
    for t in range(2):
        for slot in range(p):
            for j in (0, s - 1):  # word t*S + j, slot `slot` -> input t*128 + slot*S + j
                assert torch.equal(words[:, t * s + j, slot], codes[:, t * 128 + slot * s + j])


@pytest.mark.parametrize("bits,zeros,group", [(4, False, 128), (4, True, 256),
                                              (8, True, -1), (8, False, 128)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_stripe_gemm_matches_reference(bits: int, zeros: bool, group: int, m: int) -> None:
    n, k = 24, 512
    qw, sc, zp = _weight(n, k, bits, group, zeros, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    st = to_stripes(qw, bits).to(DEVICE)
    got = stripe_gemm(x.to(DEVICE), st, sc.to(DEVICE), None if zp is None else zp.to(DEVICE),
                      bits, group).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, bits, group)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("config", [(4, 8, 2, 4, 1, 2), (16, 16, 1, 4, 2, 2)])
def test_stripe_gemm_split_k_with_a_ragged_chunk(config: tuple[int, ...]) -> None:
    n, k = 20, 640  # 5 stripes: split 2 of 2-stripe steps leaves a masked step
    qw, sc, zp = _weight(n, k, 4, 128, True, 7)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    got = stripe_gemm(x.to(DEVICE), to_stripes(qw, 4).to(DEVICE), sc.to(DEVICE),
                      zp.to(DEVICE), 4, 128, config=config).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, 4, 128)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("stripes", [1, 4, 8])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 256), (8, -1)])
def test_gemv_zero_points_at_every_step_width(stripes: int, bits: int, group: int) -> None:
    """The GEMV runs the symmetric loop and adds the zero points once per stripe (a
    ``[BLOCK_N]`` correction, module doc): steps of 1..8 stripes, groups of one stripe,
    two, or the whole row, a masked last step (K = 6 stripes), 1 and 4 rows of x."""
    n, k = 20, 768
    qw, sc, zp = _weight(n, k, bits, group, True, stripes)
    st, sc_d, zp_d = to_stripes(qw, bits).to(DEVICE), sc.to(DEVICE), zp.to(DEVICE)  # type: ignore[union-attr]
    for m, bm in ((1, 1), (3, 4)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = stripe_gemm(x.to(DEVICE), st, sc_d, zp_d, bits, group,
                          config=(bm, 8, stripes, 4, 1, 1)).cpu()
        ref = wna16_ref(x, qw, sc, zp, None, bits, group)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("m,zeros,split", [(1, False, 1), (3, True, 1), (1, True, 2)])
def test_gemv_register_prefetch_is_bit_identical(m: int, zeros: bool, split: int) -> None:
    """The GEMV's ``ahead`` flag (a tuned-table option) only moves loads: the same sums in
    the same order as without it, split-K chunks included.  Bit for bit under the
    interpreter; on a GPU the zero-point correction's reductions are the compiler's to
    order in each variant (an H100 differed at M = 1, split 2), so there: to rounding."""
    n, k = 24, 1024
    qw, sc, zp = _weight(n, k, 4, 128, zeros, 9)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    args = (to_stripes(qw, 4).to(DEVICE), sc.to(DEVICE),
            None if zp is None else zp.to(DEVICE), 4, 128)
    bm = 1 if m == 1 else 4
    plain = stripe_gemm(x, *args, config=(bm, 8, 2, 4, 1, split))
    ahead = stripe_gemm(x, *args, config=(bm, 8, 2, 4, 1, split, 1))
    if zeros and DEVICE == "cuda":
        assert float((plain - ahead).abs().max()) <= 1e-6 * float(plain.abs().max())
    else:
        assert torch.equal(plain, ahead)
    ref = wna16_ref(x.cpu(), qw, sc, zp, None, 4, 128)
    assert float((ahead.cpu() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("bits,zeros", [(4, True), (8, False)])
def test_stripe_dequantize_is_exact(bits: int, zeros: bool) -> None:
    n, k = 20, 384
    qw, sc, zp = _weight(n, k, bits, 128, zeros, 3)
    out = torch.empty(n, k, device=DEVICE)
    stripe_dequantize(to_stripes(qw, bits).to(DEVICE), sc.to(DEVICE),
                      None if zp is None else zp.to(DEVICE), bits, 128, out)
    assert torch.equal(out.cpu(), dequantize(qw, sc, zp, None, bits, 128))


def test_stripe_gemm_rejects_a_group_it_cannot_stripe() -> None:
    qw, sc, _ = _weight(8, 256, 4, 64, False, 0)
    with pytest.raises(ValueError, match="group_size"):
        stripe_gemm(torch.randn(1, 256), qw, sc, None, 4, 64)


def test_act_order_layer_is_permuted_at_load_and_exact(monkeypatch) -> None:
    """GPTQ act-order (equal groups, a random order), symmetric: stored striped with the
    inputs permuted; the layer's dequantised weight, un-permuted, is the format's; the
    product matches ``x @ w^T``."""
    from pagedllm.kernels import wna16_kmajor
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import apply_cuda, store_cuda

    # the striped storage under test, whatever K-major table this GPU ships
    monkeypatch.setattr(wna16_kmajor, "has_table", lambda: False)
    n, k, g = 16, 256, 128
    qw, sc, zp = _weight(n, k, 4, g, False, 5)
    gen = torch.Generator().manual_seed(6)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // g).to(torch.int32)
    iw = IntWeight(qw, sc, zp, g_idx, 4, g)
    with torch.device(DEVICE):
        layer = ReplicatedLinear(k, n, bias=False, prefix="x")
    layer.register_buffer("int_perm", None, persistent=False)
    assert zp is None
    store_cuda(layer, IntWeight(qw.to(DEVICE), sc.to(DEVICE), None, g_idx.to(DEVICE), 4,
                                g), torch.float32)
    assert layer.int_layout == "stripe" and layer.int_g_idx is None
    perm = layer.int_perm.cpu()
    zeros = None if layer.int_zeros is None else layer.int_zeros.cpu()
    w = dequantize(from_stripes(layer.int_qweight.cpu(), 4), layer.int_scales.cpu(), zeros,
                   None, 4, g)
    ref_w = iw.dequantize(torch.float32)
    assert torch.equal(w, ref_w[:, perm])
    x = torch.randn(2, k, generator=gen)
    got = apply_cuda(layer, x.to(DEVICE)).cpu()
    ref = x @ ref_w.T
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cpu"
                         else [torch.float32, torch.float16, torch.bfloat16])
def test_w8a8_quantiser_is_the_librarys(dtype: torch.dtype) -> None:
    """The one-launch quantiser equals compressed-tensors' own dynamic per-token int8
    quantisation (its ``calculate_qparams`` and ``quantize``), ties and a zero row
    included."""
    cq = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[2] = 0
    x[3, :6] = torch.tensor([127.5, -127.5, 0.5, 1.5, 2.5, -0.5])
    x = x.to(dtype)
    args = cq.QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                               dynamic=True)
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    scale, zero = calculate_qparams(lo, hi, args)
    ref_q = quantize(x, scale, zero, args, dtype=torch.int8)
    q, s = quant_per_token_int8(x.to(DEVICE), compressed_tensors=True)
    assert torch.equal(q.cpu(), ref_q)
    assert torch.equal(s.cpu(), scale.float())


@pytest.mark.gpu
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 3, 16, 256])
def test_gpu_stripe_gemm_llama3_shapes(n: int, k: int, m: int, zeros: bool) -> None:
    qw, sc, zp = _weight(n, k, 4, 128, zeros, m)
    qw, sc = qw.cuda(), sc.to(torch.bfloat16).cuda()
    zp = None if zp is None else zp.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = stripe_gemm(x, to_stripes(qw, 4), sc, zp, 4, 128)
    ref = wna16_ref(x.float(), qw, sc, zp, None, 4, 128)
    # bf16 output rounding (2**-8 relative) plus fp32 accumulation-order differences
    assert float((got.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())


def test_tuned_table_overrides_configs_and_thresholds(tmp_path, monkeypatch) -> None:
    """``PAGEDLLM_WNA16_CONFIGS`` (the sweep's ``--table``): the entry of the smallest
    swept M >= M at (N, K) wins, other shapes keep the priors, and its summary sets the
    dispatch thresholds."""
    import json

    from pagedllm.kernels import wna16_stripe as ws
    from pagedllm.layers.quantization import int_cuda

    def clear() -> None:
        ws._tuned_file.cache_clear()
        ws.tuned_table.cache_clear()
        ws.stripe_config.cache_clear()

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": [[4, 64, 256, [4, 4, 1, 4, 1, 1]],
                                            [64, 64, 256, [16, 32, 2, 4, 3, 2]]],
                                "summary": {"dequant_min_m": 256}}))
    monkeypatch.setenv("PAGEDLLM_WNA16_CONFIGS", str(path))
    clear()
    try:
        cpu = torch.device("cpu")
        assert ws.stripe_config(3, 64, 256, cpu) == (4, 4, 1, 4, 1, 1)
        assert ws.stripe_config(5, 64, 256, cpu) == (16, 32, 2, 4, 3, 2)
        assert ws.stripe_config(3, 128, 256, cpu)[0] == 4  # not in the table: priors
        assert int_cuda.dequant_min_m() == 256
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_CONFIGS")
        clear()


def test_dequant_linear_whole_layer() -> None:
    """The large-M path: dequantise the whole layer into a scratch, then the GEMM."""
    from pagedllm.layers.quantization.int_cuda import dequant_linear

    n, k = 24, 256
    qw, sc, zp = _weight(n, k, 4, 128, True, 9)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    scratch = torch.empty(n * k, device=DEVICE)
    got = dequant_linear(x.to(DEVICE), to_stripes(qw, 4).to(DEVICE), sc.to(DEVICE),
                         zp.to(DEVICE), 4, 128, scratch).cpu()
    ref = wna16_ref(x, qw, sc, zp, None, 4, 128)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
