"""W8A8-INT8 (``kernels/int8_gemm.py``): the per-token int8 quantiser against its torch
reference (exactly: same scale, same half-to-even rounding), and both GEMM paths (the
Triton kernel; ``torch._int_mm`` plus the Triton scale epilogue) against an exact integer
product scaled in fp64.  GPU cases (marked ``gpu``) run the Llama-3-8B projections and
check which path each row count takes."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.int8_gemm import (
    int8_gemm,
    int8_gemm_int_mm,
    int8_gemm_ref,
    int8_gemm_triton,
    int_mm_applies,
    quant_per_token_int8,
    quant_per_token_int8_ref,
)

EPS_OUT = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantised activations (rows of very different sizes), random int8
    weights and per-channel scales, on ``gen``'s device."""
    dev = gen.device
    x = torch.randn(m, k, generator=gen, device=dev) \
        * torch.logspace(-2, 2, m, device=dev)[:, None]
    x_q, x_s = quant_per_token_int8_ref(x.to(dtype))
    w_q = torch.randint(-128, 128, (n, k), generator=gen, device=dev, dtype=torch.int8)
    w_s = torch.rand(n, generator=gen, device=dev) * 1e-3 + 1e-4
    return x_q, x_s, w_q, w_s


def _check(got: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor,
           w_s: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    assert got.dtype == dtype and got.shape == (x_q.shape[0], w_q.shape[0])
    # fp64 on the tensors' device: the integer sums are exact (< 2**53).
    acc = x_q.double() @ w_q.double().T
    scale = x_s.double().reshape(-1, 1) * w_s.double().reshape(1, -1)
    ref = acc * scale
    abs_sum = (x_q.double().abs() @ w_q.double().abs().T) * scale
    got = got.double()
    assert not got.isnan().any(), f"unwritten outputs (seed={seed})"
    # fp32 scaling (and split-K partial sums), then one rounding to dtype: relative for
    # normal results, one subnormal step absolute near zero (fp16's is 2**-24, 6e-8).
    fi = torch.finfo(dtype)
    bound = 1e-6 * abs_sum + EPS_OUT[dtype] * ref.abs() + fi.smallest_normal * fi.eps
    excess = ((got - ref).abs() - bound).max().item()
    assert excess <= 0, f"max abs err {(got - ref).abs().max().item():.3g} (seed={seed})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (5, 6000)])
def test_quant_per_token_int8_matches_reference(shape: tuple[int, int],
                                                dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]
    x[0] = 0.0  # a zero token: scale at its floor, codes 0
    # amax 127 -> scale 1: halves round to even, and the extremes are +-127.
    x[1, :8] = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5])
    x = x.to(dtype).to(DEVICE)
    q, s = quant_per_token_int8(x)
    rq, rs = quant_per_token_int8_ref(x)
    assert q.dtype == torch.int8 and s.shape == (shape[0], 1)
    assert torch.equal(s, rs)
    assert torch.equal(q, rq)
    assert q[1, :8].tolist() == [127, -127, 0, 2, 2, 0, -2, 126]
    assert not q[0].any()


@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_int8_gemm_triton_matches_reference(m: int) -> None:
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    for dtype, (n, k) in zip([torch.float32, torch.float16, torch.bfloat16],
                             [(48, 200), (40, 256), (24, 136)]):
        ops = _operands(m, n, k, dtype, gen)
        _check(int8_gemm_triton(*ops, dtype), *ops, dtype, seed)
    # A forced split with an empty last step, and no split.
    ops = _operands(m, 40, 200, torch.bfloat16, gen)
    for config in [(16, 32, 32, 4, 1, 3), (16, 64, 256, 4, 1, 1)]:
        _check(int8_gemm_triton(*ops, torch.bfloat16, config=config), *ops,
               torch.bfloat16, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_int_mm_path_matches_reference(dtype: torch.dtype) -> None:
    """``torch._int_mm`` runs on the CPU too, so its epilogue is tested here."""
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    ops = _operands(24, 40, 64, dtype, gen)
    _check(int8_gemm_int_mm(*ops, dtype), *ops, dtype, seed)
    # The public entry point picks a path by shape; on the CPU it is the Triton kernel
    # under the interpreter (int_mm applies only on CUDA) or the reference.
    assert not int_mm_applies(*ops[::2]) or ON_GPU
    _check(int8_gemm(*ops, dtype), *ops, dtype, seed)
    torch.testing.assert_close(int8_gemm_ref(*ops, torch.float32),
                               int8_gemm_int_mm(*ops, torch.float32), rtol=0, atol=0)


def test_int8_gemm_rejects_bad_arguments() -> None:
    gen = torch.Generator(DEVICE).manual_seed(0)
    x_q, x_s, w_q, w_s = _operands(4, 16, 32, torch.float32, gen)
    cases = [
        ((x_q.float(), x_s, w_q, w_s, torch.float32), "x_q"),
        ((x_q, x_s, w_q[:, :16], w_s, torch.float32), "w_q"),
        ((x_q, x_s[:2], w_q, w_s, torch.float32), "x_scale"),
        ((x_q, x_s, w_q, w_s.half(), torch.float32), "w_scale"),
        ((x_q, x_s, w_q, w_s, torch.int32), "out_dtype"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            int8_gemm(*args)
    with pytest.raises(ValueError, match="x"):
        quant_per_token_int8(torch.zeros(4, dtype=torch.float32, device=DEVICE))


LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 64, 2048])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_gpu_int8_gemm_llama3_shapes(n: int, k: int, m: int) -> None:
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x_q, x_s, w_q, w_s = _operands(m, n, k, torch.bfloat16, gen)
    assert int_mm_applies(x_q, w_q) == (m > 16)
    _check(int8_gemm(x_q, x_s, w_q, w_s, torch.bfloat16), x_q, x_s, w_q, w_s,
           torch.bfloat16, seed)
    _check(int8_gemm_triton(x_q, x_s, w_q, w_s, torch.bfloat16), x_q, x_s, w_q, w_s,
           torch.bfloat16, seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    q, s = quant_per_token_int8(x)
    rq, rs = quant_per_token_int8_ref(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # The GPU's fp32 division may round a quotient differently by one ulp: one code.
    assert (q.int() - rq.int()).abs().max().item() <= 1
