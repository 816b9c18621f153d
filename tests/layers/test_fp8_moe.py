"""FP8 MoE experts (``layers/quantization/fp8_moe.py``) on the CPU: the layer against the
float experts it quantised (random shapes, uneven routing, experts with no tokens), the
checkpoint scale layouts (per tensor, per channel, tensor-parallel slices), the
refusals (block-wise FP8, half-given scales), and dummy weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.kernels.quant_common import FP8_DTYPE, quantize_fp8_rows
from pagedllm.layers.fused_moe import FusedMoE, select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref
from pagedllm.layers.quantization.fp8 import Fp8Config
from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod


def _float_experts(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes: per-channel scales must differ to be right.
    w13 = torch.randn(e, 2 * i, h, generator=g) * torch.rand(e, 2 * i, 1, generator=g)
    w2 = torch.randn(e, h, i, generator=g) * torch.rand(e, h, 1, generator=g) * i ** -0.5
    return w13 * h ** -0.5, w2


def _load(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Feed the layer one checkpoint matrix at a time, as the model loader does."""
    i = w2.shape[2]
    for e in range(w13.shape[0]):
        layer.w13_weight.weight_loader(layer.w13_weight, w13[e, :i], "w1", e)
        layer.w13_weight.weight_loader(layer.w13_weight, w13[e, i:], "w3", e)
        layer.w2_weight.weight_loader(layer.w2_weight, w2[e], "w2", e)


def _routing(kind: str, t: int, e: int, k: int, seed: int):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed))
    if kind == "one_expert_takes_all":
        logits[:, 1] += 100.0
    elif kind == "half_idle":
        logits[:, e // 2:] -= 100.0
    return logits


def _dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return w.float() * s[..., None]


@pytest.mark.parametrize("kind", ["random", "one_expert_takes_all", "half_idle"])
@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 96), (13, 16, 3, 48, 40),
                                       (40, 6, 1, 32, 24)])
def test_quantised_at_load_matches_float(kind: str, t: int, e: int, k: int, h: int,
                                         i: int) -> None:
    w13, w2 = _float_experts(e, h, i, seed=t + e)
    layer = FusedMoE(e, k, h, i, renormalize=True, quant_config=Fp8Config())
    assert isinstance(layer.quant_method, Fp8MoEMethod)
    _load(layer, w13, w2)
    assert layer.w13_weight.dtype == FP8_DTYPE and layer.w2_weight.dtype == FP8_DTYPE
    assert layer.w13_weight_scale.shape == (e, 2 * i)
    assert layer.w2_weight_scale.shape == (e, h)
    # The stored values are the per-channel quantisation of each float row.
    q, s = quantize_fp8_rows(w13.reshape(-1, h))
    assert torch.equal(layer.w13_weight.view(torch.uint8).reshape(-1, h), q.view(torch.uint8))
    torch.testing.assert_close(layer.w13_weight_scale.reshape(-1), s.reshape(-1))

    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    logits = _routing(kind, t, e, k, seed=e)
    out = layer(x, logits)
    weights, ids = select_experts(logits, k, True)
    # Exactly the float reference on the dequantised weights ...
    deq = fused_experts_ref(x, _dequant(layer.w13_weight, layer.w13_weight_scale),
                            _dequant(layer.w2_weight, layer.w2_weight_scale), weights, ids)
    torch.testing.assert_close(out, deq, atol=1e-6, rtol=1e-5)
    # ... and near the float experts (e4m3: 3 mantissa bits, ~2-3% per weight).
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert float((out - ref).norm() / ref.norm()) < 0.06


def test_bf16_activations() -> None:
    w13, w2 = _float_experts(8, 64, 32, seed=3)
    layer = FusedMoE(8, 2, 64, 32, renormalize=False, quant_config=Fp8Config())
    _load(layer, w13, w2)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    logits = _routing("half_idle", 9, 8, 2, seed=3)
    out = layer(x.bfloat16(), logits)
    assert out.dtype == torch.bfloat16
    weights, ids = select_experts(logits, 2, False)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert float((out.float() - ref).norm() / ref.norm()) < 0.06


def test_checkpoint_scales_per_tensor_and_per_channel() -> None:
    """A serialized (e4m3 + weight_scale) expert bank: per-tensor scalars broadcast over
    the rows, per-channel ``[out, 1]`` columns; the result is the dequantised float."""
    e, h, i = 4, 32, 16
    w13, w2 = _float_experts(e, h, i, seed=5)
    layer = FusedMoE(e, 2, h, i, renormalize=True,
                     quant_config=Fp8Config(serialized=True))
    assert isinstance(layer.w13_weight_scale, torch.nn.Parameter)  # from the checkpoint
    full13 = torch.empty(e, 2 * i, h)
    full2 = torch.empty(e, h, i)
    for ex in range(e):
        for shard, rows, per_tensor in (("w1", slice(0, i), True), ("w3", slice(i, 2 * i),
                                                                      False)):
            m = w13[ex, rows]
            if per_tensor:
                s = m.abs().amax() / 448.0
                q = (m / s).to(FP8_DTYPE)
                full13[ex, rows] = q.float() * s
            else:
                q, s = quantize_fp8_rows(m)  # s [out, 1]
                full13[ex, rows] = q.float() * s
            layer.w13_weight.weight_loader(layer.w13_weight, q, shard, ex)
            layer.w13_weight_scale.weight_loader(layer.w13_weight_scale, s, shard, ex)
        q, s = quantize_fp8_rows(w2[ex])
        full2[ex] = q.float() * s
        layer.w2_weight.weight_loader(layer.w2_weight, q, "w2", ex)
        layer.w2_weight_scale.weight_loader(layer.w2_weight_scale, s.reshape(-1), "w2", ex)
    x = torch.randn(7, h, generator=torch.Generator().manual_seed(5))
    logits = _routing("random", 7, e, 2, seed=5)
    weights, ids = select_experts(logits, 2, True)
    torch.testing.assert_close(layer(x, logits),
                               fused_experts_ref(x, full13, full2, weights, ids),
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        layer.w2_weight.weight_loader(layer.w2_weight, w2[0], "w2", 0)
    with pytest.raises(ValueError, match="one per output"):
        layer.w2_weight_scale.weight_loader(layer.w2_weight_scale, torch.ones(3), "w2", 0)


def test_tensor_parallel_slices() -> None:
    """Rank 1 of 2: its half of every gate/up row block and of the down columns, and the
    matching scales (gate/up scales sliced, down scales whole)."""
    e, h, i = 3, 32, 16
    w13, w2 = _float_experts(e, h, i, seed=6)
    whole = FusedMoE(e, 2, h, i, True, quant_config=Fp8Config(serialized=True))
    rank1 = FusedMoE(e, 2, h, i, True, tp_size=2, tp_rank=1,
                     quant_config=Fp8Config(serialized=True))
    for ex in range(e):
        for shard, m in (("w1", w13[ex, :i]), ("w3", w13[ex, i:]), ("w2", w2[ex])):
            q, s = quantize_fp8_rows(m)
            for layer in (whole, rank1):
                p = layer.w2_weight if shard == "w2" else layer.w13_weight
                ps = layer.w2_weight_scale if shard == "w2" else layer.w13_weight_scale
                p.weight_loader(p, q, shard, ex)
                ps.weight_loader(ps, s, shard, ex)
    half = i // 2
    for g0 in (0, i):  # gate block, up block
        assert torch.equal(rank1.w13_weight.view(torch.uint8)[:, g0 // 2:g0 // 2 + half],
                           whole.w13_weight.view(torch.uint8)[:, g0 + half:g0 + i])
        assert torch.equal(rank1.w13_weight_scale[:, g0 // 2:g0 // 2 + half],
                           whole.w13_weight_scale[:, g0 + half:g0 + i])
    assert torch.equal(rank1.w2_weight.view(torch.uint8),
                       whole.w2_weight.view(torch.uint8)[:, :, half:])
    assert torch.equal(rank1.w2_weight_scale, whole.w2_weight_scale)


def _block_quantise(w: torch.Tensor, bo: int, bi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``w`` with one scale per ``bo x bi`` block (edge blocks partial), and the
    ``[ceil(rows / bo), ceil(cols / bi)]`` scales: the fine-grained FP8 layout."""
    rows, cols = w.shape
    inv = torch.empty(-(-rows // bo), -(-cols // bi))
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    for r in range(inv.shape[0]):
        for c in range(inv.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            inv[r, c] = blk.abs().amax() / 448.0
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / inv[r, c]).to(FP8_DTYPE)
    return q, inv


def _block_dequant(q: torch.Tensor, inv: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    full = inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


@pytest.mark.parametrize("scale_name", ["weight_scale_inv", "weight_scale"])
def test_block_wise_fp8_folded_per_channel(scale_name: str) -> None:
    """Block scales (edge blocks partial: I = 24, H = 40 over 16 x 16 blocks) fold at
    load into per-channel ones: the layer then equals the block-dequantised float
    experts up to one more e4m3 rounding; a tensor-parallel slice that is not whole
    blocks is refused naming weight_block_size."""
    e, h, i, b = 3, 40, 24, 16
    w13, w2 = _float_experts(e, h, i, seed=8)
    cfg = Fp8Config(serialized=True, block_size=(b, b))
    if scale_name == "weight_scale_inv":  # HF's name
        layer = FusedMoE(e, 2, h, i, True, quant_config=cfg)
    else:  # compressed-tensors' name for block scales
        method = Fp8MoEMethod(True, block_size=(b, b), block_scale_name=scale_name)
        layer = FusedMoE(e, 2, h, i, True,
                         quant_config=SimpleNamespace(get_moe_method=lambda *a: method))
    deq13, deq2 = torch.empty_like(w13), torch.empty_like(w2)
    for ex in range(e):
        for shard, m, rows in (("w1", w13[ex, :i], slice(0, i)),
                               ("w3", w13[ex, i:], slice(i, 2 * i)), ("w2", w2[ex], None)):
            q, inv = _block_quantise(m, b, b)
            p = layer.w2_weight if shard == "w2" else layer.w13_weight
            ps = getattr(layer, ("w2_" if shard == "w2" else "w13_") + scale_name)
            p.weight_loader(p, q, shard, ex)
            ps.weight_loader(ps, inv, shard, ex)
            if shard == "w2":
                deq2[ex] = _block_dequant(q, inv, b, b)
            else:
                deq13[ex, rows] = _block_dequant(q, inv, b, b)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.w13_weight_scale.shape == (e, 2 * i) and not hasattr(
        layer, "w13_weight_scale_inv")
    x = torch.randn(11, h, generator=torch.Generator().manual_seed(8))
    logits = _routing("half_idle", 11, e, 2, seed=8)
    weights, ids = select_experts(logits, 2, True)
    ref = fused_experts_ref(x, deq13, deq2, weights, ids)
    assert float((layer(x, logits) - ref).norm() / ref.norm()) < 0.04
    with pytest.raises(ValueError, match=r"weight_block_size \[16, 16\]"):
        FusedMoE(e, 2, h, i, True, tp_size=2, tp_rank=0, quant_config=cfg)


def test_ignored_experts_stay_unquantised() -> None:
    cfg = Fp8Config(serialized=True, ignored=["re:.*experts$"])
    layer = FusedMoE(4, 2, 32, 16, True, quant_config=cfg, prefix="model.layers.0.mlp.experts")
    assert layer.w13_weight.dtype == torch.get_default_dtype()


def test_dummy_init_fills_e4m3_and_scales() -> None:
    layer = FusedMoE(4, 2, 32, 16, True, quant_config=Fp8Config())
    assert layer.quant_method.dummy_init(layer, torch.Generator().manual_seed(0), "uniform")
    deq = _dequant(layer.w13_weight, layer.w13_weight_scale)
    assert 0 < float(deq.abs().max()) <= 1e-3 * 1.01
    assert torch.isfinite(layer(torch.randn(5, 32), torch.randn(5, 4))).all()
