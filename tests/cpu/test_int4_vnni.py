"""The CPU int4 GEMM for VNNI and AVX2 CPUs (``layers/quantization/int4_vnni.py``): every
test runs on the CPU's own kernels and again on the AVX2 ones (``force_avx2``), so a VNNI
machine checks both.

Fixtures: GGUF Q4_1 (one int4 part) and Q8_0 (two parts) tensors written by gguf-py's
quantiser, split by ``gguf_blocks.int4_parts``, packed by ``PackedInt4``; a Q8_0 table as
one ``PackedInt8`` (the 8-bit kernel the embedding and LM head take); each with int16
activations and with int8 ones (``act8``, the layouts GGUF weights take by default).
References: the float64 product with the weight as the parts store it (scale and zero in
bf16), with x itself and with x rounded per 32 columns as the kernel documents (int16 or
int8 codes for the scaled term, x itself for the zero term), and the float64 product
with gguf-py's own dequantisation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagedllm.layers.quantization import gguf_blocks as gb
from pagedllm.layers.quantization import int4_vnni
from pagedllm.layers.quantization.int4pack import PackedInt4, PackedInt8, mm_parts

pytestmark = pytest.mark.skipif(not int4_vnni.available(),
                                reason="no C compiler or neither AVX512-VNNI nor AVX2 here")


@pytest.fixture(autouse=True, params=["native", "avx2"])
def isa(request: pytest.FixtureRequest):
    """The CPU's own kernels, then the AVX2 ones."""
    if request.param == "avx2" and not int4_vnni.force_avx2(True):
        pytest.skip("the library has no AVX2 kernels (built without AVX2 + FMA)")
    try:
        yield request.param
    finally:
        int4_vnni.force_avx2(False)


ACT = pytest.mark.parametrize("act8", [False, True], ids=["int16-x", "int8-x"])


def _parts(qtype: Q, n: int, k: int, act8: bool = False
           ) -> tuple[list[PackedInt4], torch.Tensor, list]:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, qtype)
    gguf_ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    split = gb.int4_parts(torch.from_numpy(raw), qtype, k)
    parts = [PackedInt4(v, s, z, gb.GROUP, torch.device("cpu"), act8) for v, s, z in split]
    return parts, gguf_ref, split


def _stored_weight(split: list, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as stored, in float64 with s, z rounded to bf16: its scaled term
    sum_p (v_p - 8) * s_p and its zero term sum_p z_p."""
    ws, wz = 0, 0
    for v, s, z in split:
        s64 = s.to(torch.bfloat16).double().repeat_interleave(group, 1)
        wz = wz + z.to(torch.bfloat16).double().repeat_interleave(group, 1)
        ws = ws + (v.double() - 8) * s64
    return ws, wz


def _rounded_rows(x: torch.Tensor, act8: bool) -> torch.Tensor:
    """x rounded as the kernel rounds it: per 32 columns to d * round(x / d), d = amax /
    32767 (int16) or amax / 127 (int8)."""
    top = 127.0 if act8 else 32767.0
    b = x.float().view(x.shape[0], -1, 32)  # float32 steps, as the kernel takes them
    amax = b.abs().amax(-1, keepdim=True)
    # A true float32 division, as the kernel's ``top / amax``: ``top / amax`` on a tensor
    # is ``amax.reciprocal() * top``, one rounding more, which moves a product lying on a
    # half-way point to the other code (about one draw in 130 at m = 17).
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)  # half to even, as vcvtps2dq
    return (q.double() * (amax / top).double()).view(x.shape)


@ACT
@pytest.mark.parametrize("qtype,n,k", [(Q.Q4_1, 96, 256), (Q.Q8_0, 128, 576)],
                         ids=["q4_1", "q8_0-two-parts"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_matches_the_stored_weights(qtype: Q, n: int, k: int, m: int, act8: bool) -> None:
    parts, gguf_ref, split = _parts(qtype, n, k, act8)
    assert all(p.layout == ("vnni4x8" if act8 else "vnni4") for p in parts)
    x = torch.randn(m, k)
    y = mm_parts(x, parts)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ws, wz = _stored_weight(split, gb.GROUP)
    exact = x.double() @ (ws + wz).t()
    scale = exact.abs().max()
    # The kernel's own arithmetic: rounded x in the scaled term, x in the zero term.
    xr = _rounded_rows(x, act8).double()
    assert (y.double() - (xr @ ws.t() + x.double() @ wz.t())).abs().max() / scale < 2e-5
    # Against the exact product: int16 activations within 1e-4, int8 within 2e-2.
    assert (y.double() - exact).abs().max() / scale < (2e-2 if act8 else 1e-4)
    # The format's own dequantisation differs by the bf16 rounding of its scales (and
    # the int8 rounding of x).
    assert (y.double() - x.double() @ gguf_ref.t()).abs().max() / scale < 3e-2


@ACT
def test_rows_do_not_depend_on_the_batch_or_threads(act8: bool) -> None:
    parts, _, _ = _parts(Q.Q4_1, 256, 512, act8)
    x = torch.randn(9, 512)
    together = mm_parts(x, parts)
    alone = torch.cat([mm_parts(x[i:i + 1], parts) for i in range(9)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm_parts(x, parts), together)
    finally:
        torch.set_num_threads(threads)


@ACT
def test_gathered_rows_are_the_codes_and_layout_switch(act8: bool) -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 16, (128, 64), generator=g)
    s, z = torch.rand(128, 2, generator=g), torch.randn(128, 2, generator=g)
    part = PackedInt4(v, s, z, 32, torch.device("cpu"), act8)
    ids = torch.tensor([0, 15, 16, 31, 32, 77, 127])
    assert torch.equal(part.gather_rows(ids).long(), v[ids])
    assert part.packed.numel() == 128 * 64 // 2  # 4 bits per weight, as torch's layout


def test_without_vnni_keeps_torchs_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_vnni, "available", lambda: False)  # a CPU with neither VNNI nor AVX2
    parts, gguf_ref, _ = _parts(Q.Q4_1, 64, 128)
    assert parts[0].layout == "torch"
    x = torch.randn(2, 128)
    want = x.double() @ gguf_ref.t()
    assert ((mm_parts(x, parts).double() - want).abs().max() / want.abs().max()) < 2e-2


def _q8_table(n: int, k: int, act8: bool = False
              ) -> tuple[PackedInt8, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0 table by gguf-py's quantiser as one ``PackedInt8`` (the codes ``q + 128``),
    gguf-py's dequantisation in float64, the codes and the block scales."""
    w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, Q.Q8_0)
    ref = torch.from_numpy(dequantize(raw, Q.Q8_0).reshape(n, k)).double()
    u, d = gb.q8_0_codes(torch.from_numpy(raw), k)
    return PackedInt8(u, d, torch.zeros_like(d), gb.GROUP, act8), ref, u, d


@ACT
@pytest.mark.parametrize("m", [1, 2, 5, 33])
def test_int8_table_matches_gguf_py(m: int, act8: bool) -> None:
    part, ref, u, d = _q8_table(96, 576, act8)
    assert part.layout == ("vnni8x8" if act8 else "vnni8")
    assert part.packed.numel() == 96 * 576  # one byte per weight
    x = torch.randn(m, 576)
    y = mm_parts(x, [part])
    # The stored weight: (u - 128) * d with d in bf16 (Q8_0's d is fp16: bf16 rounds it).
    stored = (u.double() - 128) * d.to(torch.bfloat16).double().repeat_interleave(gb.GROUP, 1)
    exact = x.double() @ stored.t()
    scale = exact.abs().max()
    xr = _rounded_rows(x, act8).double()
    assert (y.double() - xr @ stored.t()).abs().max() / scale < 2e-5
    assert (y.double() - exact).abs().max() / scale < (2e-2 if act8 else 1e-4)
    assert (y.double() - x.double() @ ref.t()).abs().max() / scale < 3e-2


@ACT
def test_int8_table_rows_and_codes(act8: bool) -> None:
    part, _, u, _ = _q8_table(64, 128, act8)
    x = torch.randn(7, 128)
    together = mm_parts(x, [part])
    assert torch.equal(together, torch.cat([mm_parts(x[i:i + 1], [part]) for i in range(7)]))
    ids = torch.tensor([0, 15, 16, 31, 63])
    assert torch.equal(part.gather_rows(ids), u[ids])
