"""The batch-1 decode GEMV (``kernels/gemv.py``) against an fp64 ``x @ W^T + b``, with
SiLU-and-mul fused into its input against ``kernels/activation.py`` then the matmul, and
with the (residual add +) RMSNorm fused into its input against ``kernels/norm.py`` then
the matmul.

Outputs are poisoned with NaN first so an unwritten element fails.  Shapes include K
not a multiple of the K step and N not a multiple of the rows per program."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.gemv import gemv, gemv_rmsnorm
from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_GPU else [])
CONFIGS = [None, (4, 64, 2), (16, 128, 4)]  # the default and two tuning variants


def _weights(n: int, k: int, dtype: torch.dtype, bias: bool, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return w, b


def _check(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, silu: bool = False,
           config: tuple[int, int, int] | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2 * k if silu else k, generator=gen).to(DEVICE, dtype)
    w, b = _weights(n, k, dtype, bias, gen)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    gemv(x, w, b, out=out, silu_mul=silu, config=config)
    # The reference uses the same rounded inputs (and, fused, the rounded activation).
    _assert_matmul(out, silu_and_mul(x) if silu else x, w, b, dtype, seed, config)


def _check_norm(n: int, k: int, dtype: torch.dtype, bias: bool, residual: bool, seed: int,
                config: tuple[int, int, int] | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Scaled so that the norm matters; eps as in Llama.
    x = (3 * torch.randn(1, k, generator=gen)).to(DEVICE, dtype)
    r = torch.randn(1, k, generator=gen).to(DEVICE, dtype) if residual else None
    g = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, dtype)
    w, b = _weights(n, k, dtype, bias, gen)
    x_in, r_in = x.clone(), r.clone() if r is not None else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    res_out = torch.full((1, k), float("nan"), dtype=dtype, device=DEVICE)
    got_out, got_res = gemv_rmsnorm(x, r, g, 1e-5, w, b, out=out, res_out=res_out,
                                    config=config)
    assert got_out is out
    assert torch.equal(x, x_in), f"x was written (seed={seed})"
    if r is None:
        h = rms_norm(x, g, 1e-5)
        assert got_res is x
    else:
        h, s = fused_add_rms_norm(x, r, g, 1e-5)
        assert torch.equal(r, r_in), f"the residual was written (seed={seed})"
        # The sum is rounded once, the same way in both kernels: bit-identical.
        assert got_res is res_out and torch.equal(res_out, s), \
            f"residual sum differs or is unwritten (seed={seed})"
    _assert_matmul(out, h, w, b, dtype, seed, config, near_ties=True)


def _assert_matmul(out: torch.Tensor, xin: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None, dtype: torch.dtype, seed: int,
                   config: tuple[int, int, int] | None, near_ties: bool = False) -> None:
    """``out`` against an fp64 ``xin @ w^T + b``; NaN (unwritten) fails.  ``near_ties``:
    the kernel computed ``xin`` itself, rounding like the reference but from fp32
    statistics summed in another order, so an element on a near-tie may round the other
    way (rare, but seen in random bf16 runs); up to two such elements are allowed."""
    ref = xin.double().cpu() @ w.double().cpu().T
    if b is not None:
        ref += b.double().cpu()
    got = out.double().cpu()
    assert not got.isnan().any(), f"unwritten outputs (seed={seed})"
    # fp32 accumulation over k terms of size ~1/sqrt(k), then one rounding to dtype.
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    if dtype == torch.bfloat16 and not ON_GPU:
        ulp *= 2  # the interpreter truncates fp32 -> bf16 (see test_elementwise)
    tol = 1e-4 + ulp * ref.abs()
    if near_ties:  # one ulp of xin_j moves y_i by at most eps(dtype) |xin_j w_ij|
        terms = xin.double().cpu().abs() * w.double().cpu().abs()
        tol += 2 * torch.finfo(dtype).eps * terms.max(dim=1).values
    excess = (got - ref).abs() - tol
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


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_rmsnorm_matches_norm_then_matmul(dtype: torch.dtype,
                                               config: tuple[int, int, int] | None) -> None:
    seed = fresh_seed()
    # Ragged N and K (K not a multiple of any K step), with and without a residual.
    _check_norm(37, 300, dtype, bias=False, residual=True, seed=seed, config=config)
    _check_norm(37, 300, dtype, bias=True, residual=False, seed=seed + 1, config=config)
    _check_norm(64, 256, dtype, bias=True, residual=True, seed=seed + 2, config=config)


def test_gemv_rejects_bad_shapes() -> None:
    w = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="exactly one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(torch.zeros(1, 17, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, silu_mul=True)
    x, g = torch.zeros(1, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_rmsnorm(x, None, torch.ones(8, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        gemv_rmsnorm(x, torch.zeros(1, 8, device=DEVICE), g, 1e-5, w)
    with pytest.raises(ValueError, match="res_out"):
        gemv_rmsnorm(x, x, g, 1e-5, w, res_out=torch.zeros(2, 16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (960, 576), (576, 1536)])
def test_gpu_gemv_real_shapes(n: int, k: int) -> None:
    _check(n, k, torch.bfloat16, bias=False, seed=fresh_seed())
    _check(n, k, torch.bfloat16, bias=False, seed=fresh_seed(), silu=True)
    _check_norm(n, k, torch.bfloat16, bias=False, residual=True, seed=fresh_seed())
