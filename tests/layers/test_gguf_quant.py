"""GGUF tensors kept quantised (layers/quantization/gguf*.py, int4pack.py).

Fixtures come from gguf-py: ``gguf.quants.quantize`` for the types it can write (Q4_0,
Q4_1, Q8_0) and random block bytes with finite fp16 scales for the K-quants (gguf-py
only dequantises those); the reference is ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagedllm.layers.quantization import gguf_blocks as gb
from pagedllm.layers.quantization.int4pack import PackedInt4, mm_parts

N, K = 128, 512
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# fp16 scale fields (byte offsets in a block) of the types gguf-py cannot quantise.
_SCALE_FIELDS = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def _raw(qtype: Q, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        scale = (rng.random((n, k // block)) * 0.01 + 1e-3).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bitwise_gguf(qtype: Q) -> None:
    raw = _raw(qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(N, K).copy())
    ours = gb.dequantize(torch.from_numpy(raw), qtype, K)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("qtype", gb.INT4_TYPES, ids=lambda t: t.name)
def test_int4_parts_reconstruct_and_kernel(qtype: Q) -> None:
    raw = torch.from_numpy(_raw(qtype))
    ref = gb.dequantize(raw, qtype, K).double()
    parts = gb.int4_parts(raw, qtype, K)
    # Exact in real arithmetic (float64 here): only fp32 rounding of the scales remains.
    rec = sum(((v.double() - 8).view(N, -1, 32) * s.double().unsqueeze(-1)
               + z.double().unsqueeze(-1)).view(N, K) for v, s, z in parts)
    assert torch.allclose(rec, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    # Exact embedding values from the codes.
    a, b, off = gb.exact_affine(raw, qtype, K)
    code = gb.code_from_parts([v for v, _, _ in parts], qtype)
    val = a.unsqueeze(-1) * (code - off).float().view(N, -1, 32)
    val = (val if b is None else val + b.unsqueeze(-1)).view(N, K)
    assert torch.equal(val, ref.float())
    # The packed kernel against the dequantised matmul, to bf16 accuracy.
    packed = [PackedInt4(v, s, z, 32, torch.device("cpu")) for v, s, z in parts]
    x = torch.randn(5, K)
    y = mm_parts(x, packed)
    want = x.double() @ ref.t()
    err = (y.double() - want).abs().max() / want.abs().max()
    assert y.dtype == torch.float32 and err < 2e-2, err
    # Rows read back from the CPU packed layout (the embedding's gather).
    ids = torch.tensor([0, 5, 31, 32, 63, 64, 127, 5])
    for p, (v, _, _) in zip(packed, parts):
        assert torch.equal(p.gather_rows(ids), v[ids])


def test_corrupt_tensor_is_a_clear_error() -> None:
    raw = _raw(Q.Q4_1)
    with pytest.raises(ValueError, match="corrupt Q4_1 tensor: rows of"):
        gb.dequantize(torch.from_numpy(raw[:, :-20]), Q.Q4_1, K, "blk.0.attn_q.weight")
    bad = raw.copy()
    bad[3, 0:2] = np.array([np.float16(np.inf)]).view(np.uint8)
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight: corrupt GGUF tensor: non-finite"):
        gb.int4_parts(torch.from_numpy(bad), Q.Q4_1, K, "blk.0.ffn_up.weight")
