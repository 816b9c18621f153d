"""The block-scaled FP8 GEMM and its per-token-group quantiser (kernels/fp8_block_gemm.py)
against their torch references: K with a short last group, N not a multiple of the tile,
weight block rows that a tile straddles (48-row blocks under 64-column tiles), M = 1 and
M = 37, split-K, rows as wgmma's N (SWAP) and plain, bias."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU

from pagedllm.kernels import fp8_block_gemm as fb
from pagedllm.kernels.quant_common import FP8_DTYPE


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0] = 0.0  # a zero token: every group's scale at the floor
    if k > 40:
        x[-1, 40] = 3e4  # one outlier: only its own group's scale is large
    return x


def _weights(n: int, k: int, block: tuple[int, int], seed: int):
    """Random e4m3 weights and block scales spanning decades (as a checkpoint's do)."""
    g = torch.Generator().manual_seed(seed)
    w_q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    nb = (-(-n // block[0]), -(-k // block[1]))
    w_s = torch.logspace(-4, -2, nb[0] * nb[1])[torch.randperm(nb[0] * nb[1], generator=g)]
    return w_q, w_s.view(nb).contiguous()


@pytest.mark.parametrize("mk", [(1, 128), (37, 300), (5, 40)])
def test_group_quantiser_matches_reference(mk: tuple[int, int]) -> None:
    m, k = mk
    x = _x(m, k, seed=k).to(torch.bfloat16)
    q, s = fb.quantize_fp8_groups(x.to(DEVICE), 128)
    q_ref, s_ref = fb.quantize_fp8_groups_ref(x, 128)
    assert s.shape == (m, -(-k // 128)) and q.dtype == FP8_DTYPE
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def _wgmma_slack(x_q, x_s, w_q, w_s, block) -> torch.Tensor | float:  # type: ignore[no-untyped-def]
    """Hopper's FP8 wgmma adds within a group with a reduced-precision accumulator (about
    14 bits, DeepSeek-V3's report; the kernel promotes to fp32 every group): each add
    aligns to the largest magnitude so far and drops what falls below its last bit, so an
    output may be off by ~2^-14 of its group's largest term per add -- where one term
    dominates (the outlier row of ``_x``) far more than 2^-11 of the terms' sum, which an
    H100 exceeded (an error of 32 against a bound of 27, in a row whose largest output is
    9.6e4).  The bound: per group, 2^-13 x its column count x its largest term, summed
    over groups (an emulation of 13-bit truncation every four products stays within a
    quarter of it).  Under the interpreter: exact, no slack."""
    if not ON_GPU:
        return 0.0
    xd = fb.dequantize_fp8_blocks(x_q, x_s, (1, block[1]))
    wd = fb.dequantize_fp8_blocks(w_q, w_s, block)
    slack = torch.zeros(xd.shape[0], wd.shape[0])
    for lo in range(0, xd.shape[1], block[1]):
        terms = xd[:, None, lo:lo + block[1]] * wd[None, :, lo:lo + block[1]]
        slack += 2.0 ** -13 * terms.shape[-1] * terms.abs().amax(-1)
    return slack


# (block_m, block_n, warps, stages, split, swap)
CONFIGS = [(16, 64, 4, 2, 1, 1), (16, 32, 4, 2, 3, 1), (32, 64, 4, 2, 1, 0),
           (16, 64, 4, 2, 2, 0)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mnk,block", [((1, 72, 256), (128, 128)),
                                       ((37, 100, 300), (48, 128)),
                                       ((37, 72, 80), (48, 32))])
def test_block_gemm_matches_reference(config, mnk, block) -> None:
    """fp32 output: equal to the dequantised reference up to accumulation order."""
    m, n, k = mnk
    x_q, x_s = fb.quantize_fp8_groups_ref(_x(m, k, seed=m + n), block[1])
    w_q, w_s = _weights(n, k, block, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    dev = [t.to(DEVICE) for t in (x_q, x_s, w_q, w_s, bias)]
    got = fb.fp8_block_gemm(*dev[:4], block, dev[4], torch.float32, config).cpu()
    ref = fb.fp8_block_gemm_ref(x_q, x_s, w_q, w_s, block, bias, torch.float32)
    tol = 1e-5 * (ref.abs() + ref.abs().mean()) + _wgmma_slack(x_q, x_s, w_q, w_s, block)
    over = (got - ref).abs() - tol
    r, c = divmod(int(over.argmax()), n)
    assert float(over[r, c]) <= 0, (
        f"{int((over > 0).sum())} outputs off; worst at row {r}, column {c}: got "
        f"{float(got[r, c])}, reference {float(ref[r, c])}, bound {float(tol[r, c])}")


@pytest.mark.parametrize("m", [1, 37])
def test_block_linear_bf16_default_plan(m: int) -> None:
    """The whole path (group quantiser + default launch), bf16 out: within one bf16
    rounding of the reference; and near the float product (fp8 rounding of x)."""
    n, k, block = 96, 384, (128, 128)
    x = _x(m, k, seed=m).to(torch.bfloat16)
    w_q, w_s = _weights(n, k, block, seed=5)
    got = fb.fp8_block_linear(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), block,
                              None).cpu()
    assert got.dtype == torch.bfloat16
    x_q, x_s = fb.quantize_fp8_groups_ref(x, 128)
    ref = fb.fp8_block_gemm_ref(x_q, x_s, w_q, w_s, block, None, torch.float32)
    slack = _wgmma_slack(x_q, x_s, w_q, w_s, block)
    assert ((got.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6 + slack).all()
    exact = x.float() @ fb.dequantize_fp8_blocks(w_q, w_s, block).t()
    err = (got.float() - exact).norm() / exact.norm()
    assert err < 0.05, float(err)


def test_default_config() -> None:
    """Decode rows split K over ~2 waves; prefill-sized M takes 64 x 128 tiles."""
    assert fb.default_block_config(1, 4096, 7168) == (16, 64, 4, 4, 5, 1)
    assert fb.default_block_config(4096, 4096, 7168) == (64, 128, 4, 3, 1, 0)


def test_bad_operands() -> None:
    x_q = torch.zeros(4, 256, dtype=FP8_DTYPE)
    w_q = torch.zeros(64, 256, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="scales"):
        fb.fp8_block_gemm(x_q, torch.ones(4, 1), w_q, torch.ones(1, 2), (128, 128), None,
                          torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        fb.fp8_block_gemm(x_q, torch.ones(4, 3), w_q, torch.ones(1, 3), (128, 96), None,
                          torch.bfloat16)


# --------------------------------------------------------------------------- the layer


def _block_quantise(w: torch.Tensor, block: tuple[int, int]):
    """A float weight as a block-wise checkpoint stores it: e4m3 and weight_scale_inv."""
    bo, bi = block
    n, k = w.shape
    nb = (-(-n // bo), -(-k // bi))
    pad = torch.nn.functional.pad(w, (0, nb[1] * bi - k, 0, nb[0] * bo - n))
    amax = pad.view(nb[0], bo, nb[1], bi).abs().amax((1, 3))
    inv = (amax / 448.0).clamp(min=1e-12)
    full = inv.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(FP8_DTYPE), inv


def test_linear_layer_keeps_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused gate/up layer of a block-wise checkpoint keeps its block scales where the
    block GEMM runs (patched in here, as the CPU folds them) and equals the dequantised
    weight applied to per-group-quantised activations; the norm's per-token quantiser
    is not used for it."""
    from pagedllm.layers.linear import MergedColumnParallelLinear
    from pagedllm.layers.quantization import fp8

    monkeypatch.setattr(fp8, "keeps_block_scales", lambda w, b: True)
    block, k = (64, 64), 200
    layer = MergedColumnParallelLinear(k, [128, 64], quant_config=fp8.Fp8Config(
        serialized=True, block_size=block))
    g = torch.Generator().manual_seed(11)
    deq = []
    for shard, rows in enumerate((128, 64)):
        q, inv = _block_quantise(torch.randn(rows, k, generator=g) * 0.05, block)
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, inv, shard)
        deq.append(fb.dequantize_fp8_blocks(q, inv, block))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_block_scale.shape == (3, 4) and not hasattr(layer, "weight_scale_inv")
    x = _x(37, k, seed=12)
    assert layer.quant_method.rms_norm_input(layer, x, None, torch.ones(k), 1e-6) is None
    got = layer(x)
    x_q, x_s = fb.quantize_fp8_groups_ref(x, block[1])
    ref = fb.dequantize_fp8_blocks(x_q, x_s, (1, block[1])) @ torch.cat(deq).t()
    assert ((got - ref).abs() <= 1e-5 * (ref.abs() + ref.abs().mean())).all()


def test_tensor_parallel_shard_must_be_whole_blocks() -> None:
    """A rank's slice that cuts a weight block: ValueError naming weight_block_size,
    column-parallel (outputs) and row-parallel (inputs); whole blocks load."""
    from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.layers.quantization.fp8 import Fp8Config

    cfg = Fp8Config(serialized=True, block_size=(128, 128))
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\].*\[192\] features"):
        ColumnParallelLinear(256, 384, tp_size=2, tp_rank=0, quant_config=cfg,
                             prefix="model.layers.0.self_attn.q_proj")
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\].*192 input"):
        RowParallelLinear(384, 256, tp_size=2, tp_rank=1, quant_config=cfg)
    ColumnParallelLinear(256, 512, tp_size=2, tp_rank=0, quant_config=cfg)
    RowParallelLinear(512, 256, tp_size=2, tp_rank=1, quant_config=cfg)
