"""The batch-1 decode GEMV (``kernels/gemv.py``) against an fp64 ``x @ W^T + b``, and
with SiLU-and-mul (or Gemma's GELU-tanh-and-mul) fused into its input against
``kernels/activation.py`` then the matmul.

Outputs are poisoned with NaN first so an unwritten element fails.  Shapes include K
not a multiple of the K step and N not a multiple of the rows per program."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pagedllm.kernels.gemv import gemv

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_GPU else [])
CONFIGS = [None, (4, 64, 2), (16, 128, 4)]  # the default and two tuning variants


def _check(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, silu: bool = False,
           config: tuple[int, int, int] | None = None, gelu: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    silu = silu or gelu
    x = torch.randn(1, 2 * k if silu else k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    gemv(x, w, b, out=out, silu_mul=silu and not gelu, config=config, gelu_tanh_mul=gelu)
    # The reference uses the same rounded inputs (and, fused, the rounded activation).
    xin = (gelu_tanh_and_mul(x) if gelu else silu_and_mul(x)) if silu else x
    ref = xin.double().cpu() @ w.double().cpu().T
    if b is not None:
        ref += b.double().cpu()
    got = out.double().cpu()
    assert not got.isnan().any(), f"unwritten outputs (seed={seed})"
    # fp32 accumulation over k terms of size ~1/sqrt(k), then one rounding to dtype.
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    if dtype == torch.bfloat16 and not ON_GPU:
        ulp *= 2  # the interpreter truncates fp32 -> bf16 (see test_elementwise)
    excess = (got - ref).abs() - (1e-4 + ulp * ref.abs())
    assert excess.max().item() <= 0, \
        f"max abs err {(got - ref).abs().max().item()} (seed={seed}, config={config})"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_matmul(dtype: torch.dtype,
                             config: tuple[int, int, int] | None) -> None:
    seed = fresh_seed()
    _check(37, 300, dtype, bias=False, seed=seed, config=config)  # ragged N and K
    _check(64, 256, dtype, bias=True, seed=seed + 1, config=config)  # even K, bias
    _check(24, 96, dtype, bias=False, seed=seed + 2, silu=True, config=config)
    _check(40, 256, dtype, bias=True, seed=seed + 3, silu=True, config=config)
    _check(40, 300, dtype, bias=False, seed=seed + 4, gelu=True, config=config)


def test_gemv_rejects_bad_shapes() -> None:
    w = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="exactly one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(torch.zeros(1, 17, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, silu_mul=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (960, 576), (576, 1536)])
def test_gpu_gemv_real_shapes(n: int, k: int) -> None:
    _check(n, k, torch.bfloat16, bias=False, seed=fresh_seed())
    _check(n, k, torch.bfloat16, bias=False, seed=fresh_seed(), silu=True)
    _check(n, k, torch.bfloat16, bias=False, seed=fresh_seed(), gelu=True)


def test_bf16_row_fp32_weight_fp32_out() -> None:
    """DeepSeek's router at one row (``models/deepseek_moe.DeepseekRouter.logits``): a
    bf16 row against a float32 weight into a float32 output equals ``F.linear(x.float(),
    w)`` to fp32 accumulation order (64 experts, hidden 2048: V2-Lite's)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(64, 2048, generator=gen) / 2048 ** 0.5).to(DEVICE)
    from pagedllm.models.deepseek_moe import ROUTER_GEMV_CONFIG

    ref = torch.nn.functional.linear(x.float(), w)
    for config in (None, ROUTER_GEMV_CONFIG):
        out = torch.full((1, 64), float("nan"), device=DEVICE)
        gemv(x, w, out=out, config=config)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
