"""The fused gate_up + SiLU-and-mul GEMM (``kernels/gemm_silu.py``) against the unfused
torch path: ``silu(gate) * up`` with ``gate``/``up`` the projection rounded to the model
dtype, exactly as ``gate_up_proj`` then ``silu_and_mul`` compute it.

Accumulation order differs (Triton's tiles vs a single fp32 matmul), so a rounded
``gate`` may land one ulp apart and the comparison allows a few ulps of the output
dtype (more under the interpreter, whose bf16 casts truncate)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.gemm_silu import (
    DEFAULT_PLAN,
    MAX_FUSED_ROWS,
    GemmPlan,
    gate_up_silu,
    gate_up_silu_plan,
)

DTYPES = [torch.bfloat16] + ([torch.float16] if ON_GPU else [])
# Small tiles keep the interpreter quick; the default plan runs on the GPU at real sizes.
SMALL = GemmPlan(32, 32, 32, 2, 4)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    inter = w.shape[0] // 2
    gu = (x.float() @ w.float().T).to(x.dtype)
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def _check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    assert not got.isnan().any(), f"NaN/unwritten (seed={seed})"
    # bf16: a few ulps (2**-8 each) relative, over a floor for products near zero.  At
    # Llama sizes (millions of outputs) a gate one ulp off, through silu and the product,
    # reaches 5 ulps (0.020 seen on an H200); wrong data would be off by O(1).
    rel = {torch.bfloat16: 3e-2 if ON_GPU else 4e-2, torch.float16: 4e-3}[dtype]
    err = (got.float() - ref.float()).abs() / (ref.float().abs() + 0.05)
    assert err.max().item() <= rel, f"max rel err {err.max().item()} (seed={seed})"


def _inputs(rows: int, k: int, inter: int, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(2 * inter, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 40, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_silu(rows: int, tma: bool, dtype: torch.dtype) -> None:
    """Row counts below, at and across tile boundaries; rows past the last are never
    written (the output is poisoned first)."""
    seed = fresh_seed()
    x, w = _inputs(rows, 64, 96, dtype, seed)
    out = torch.full((rows, 96), float("nan"), dtype=dtype, device=DEVICE)
    gate_up_silu(x, w, SMALL._replace(tma=tma), out=out)
    _check(out, _reference(x, w), dtype, seed)


def test_strided_rows() -> None:
    """``x`` may be a row-strided view (e.g. a slice of a wider buffer)."""
    seed = fresh_seed()
    x, w = _inputs(9, 128, 64, torch.bfloat16, seed)
    wide = torch.zeros(9, 192, dtype=x.dtype, device=DEVICE)
    wide[:, :128] = x
    _check(gate_up_silu(wide[:, :128], w, SMALL), _reference(x, w), torch.bfloat16, seed)


def test_plan_only_where_it_applies() -> None:
    """The plan is shape/dtype-only and declines CPU, fp32, ragged shapes and large M."""
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    w = torch.zeros(2 * 14336, 4096, dtype=torch.bfloat16)
    assert gate_up_silu_plan(x, w) is None  # CPU
    if ON_GPU:
        xg, wg = x.cuda(), w.cuda()
        assert gate_up_silu_plan(xg, wg) == DEFAULT_PLAN
        assert gate_up_silu_plan(xg.float(), wg.float()) is None
        big = torch.zeros(MAX_FUSED_ROWS + 1, 4096, dtype=torch.bfloat16, device="cuda")
        assert gate_up_silu_plan(big, wg) is None
        assert gate_up_silu_plan(xg, wg[:, :4000].contiguous()) is None


def test_rejects_shapes_that_do_not_fit() -> None:
    x, w = _inputs(4, 64, 40, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="do not fit plan"):
        gate_up_silu(x, w, SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("rows", [1, 100, 384, 512, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_llama3_sizes(rows: int, tma: bool, dtype: torch.dtype) -> None:
    """Llama-3-8B's MLP (hidden 4096, intermediate 14336) with the default plan."""
    seed = fresh_seed()
    x, w = _inputs(rows, 4096, 14336, dtype, seed)
    _check(gate_up_silu(x, w, DEFAULT_PLAN._replace(tma=tma)), _reference(x, w), dtype,
           seed)
