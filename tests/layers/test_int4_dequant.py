"""The CPU large-M path for packed int4 weights (layers/quantization/int4_dequant.py).

Fixtures: GGUF Q4_1 (one int4 part) and Q8_0 (two parts) tensors written by gguf-py's
quantiser, split by ``gguf_blocks.int4_parts`` and packed by torch.  References: the int4
kernel itself (its weight read back through an identity matrix) and the float64 product
with gguf-py's dequantisation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagedllm.layers.quantization import gguf_blocks as gb
from pagedllm.layers.quantization import int4_dequant
from pagedllm.layers.quantization.int4pack import PackedInt4, mm_parts

N, K = 128, 256



@pytest.fixture(autouse=True, scope="module")
def _path_on():
    """The path is opt-in (PAGEDLLM_INT4_DEQUANT=1); switched on for this module only, so
    no other test's batches take it.  It reads torch's packed layout, which VNNI CPUs
    replace by their own (``int4_vnni.py``) unless ``PAGEDLLM_INT4_VNNI=0``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDLLM_INT4_DEQUANT", "1")
    mp.setenv("PAGEDLLM_INT4_VNNI", "0")
    mp.setattr(int4_dequant, "_tried", False)
    mp.setattr(int4_dequant, "_lib", None)
    try:
        if not int4_dequant.available():
            pytest.skip("no C compiler or no native bf16 GEMMs: the path is not built")
        yield
    finally:
        mp.undo()


def _parts(qtype: Q, n: int = N) -> tuple[list[PackedInt4], torch.Tensor]:
    w = np.random.default_rng(0).standard_normal((n, K)).astype(np.float32)
    raw = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, K)).double()
    parts = [PackedInt4(v, s, z, gb.GROUP, torch.device("cpu"))
             for v, s, z in gb.int4_parts(torch.from_numpy(raw), qtype, K)]
    return parts, ref


def test_dequantised_weight_is_the_kernels_weight() -> None:
    parts, _ = _parts(Q.Q4_1)
    out = torch.empty(K, N, dtype=torch.bfloat16)
    int4_dequant.dequant_t(parts, out, 0, N)
    # One nonzero product per output: the kernel's fp32 weight, rounded to bf16.
    kernel_wt = parts[0].mm(torch.eye(K, dtype=torch.bfloat16))
    torch.testing.assert_close(out.float(), kernel_wt.float(), rtol=2 ** -8, atol=1e-6)
    # A column window lands at the start of each row of ``out``.
    win = torch.zeros(K, 64, dtype=torch.bfloat16)
    int4_dequant.dequant_t(parts, win, 64, 128)
    assert torch.equal(win, out[:, 64:128])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("chunk", [4096, 64])
def test_large_m_matches_the_dequantised_product(qtype: Q, chunk: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_dequant, "CHUNK_COLS", chunk)  # 64: two column chunks
    parts, ref = _parts(qtype)
    x = torch.randn(int4_dequant.DEQUANT_MIN_ROWS + 3, K)
    y = mm_parts(x, parts)
    want = x.double() @ ref.t()
    err = (y.double() - want).abs().max() / want.abs().max()
    assert y.dtype == torch.float32 and err < 2e-2, err
    # The same rows through the int4 kernel (below the threshold) agree to bf16 rounding.
    small = torch.cat([mm_parts(x[i:i + 8], parts) for i in range(0, x.shape[0], 8)])
    assert ((small - y).abs().max() / want.abs().max()) < 2e-2


def test_shapes_outside_the_tile_layout_stay_on_the_int4_kernel() -> None:
    parts, ref = _parts(Q.Q4_1, n=80)  # packable (N % 16) but not whole 64-row tiles
    assert not int4_dequant.supports(parts)
    x = torch.randn(int4_dequant.DEQUANT_MIN_ROWS, K)
    y = mm_parts(x, parts)
    want = x.double() @ ref.t()
    assert ((y.double() - want).abs().max() / want.abs().max()) < 2e-2
    with pytest.raises(ValueError, match="bad arguments"):
        int4_dequant.dequant_t(_parts(Q.Q4_1)[0], torch.empty(K, 64, dtype=torch.bfloat16),
                               0, 100)
