"""The gated MLP's first half in one kernel: ``silu(x Wg^T) * (x Wu^T)``.

``gate_up_proj`` followed by ``silu_and_mul`` writes the ``[T, 2I]`` projection to memory
and reads it straight back (for Llama-3-8B at 512 rows: 58 MB per layer, ~11 µs, plus a
launch).  Here each program computes one ``[BLOCK_M, BLOCK_N]`` tile of *both* halves
from the fused weight ``[gate; up]`` (rows ``n`` and ``I + n``: the layout
``MergedColumnParallelLinear`` already stores, so no weight is reordered), sharing the
``x`` tile between the two dots, and writes only the ``[T, I]`` activation.

Rounding follows the unfused path: each accumulator is rounded to the model dtype (what
the GEMM would have stored), then ``silu`` in fp32 rounded, then the product rounded --
the contract of ``kernels/activation.py``.  The accumulation order is Triton's, not
cuBLAS's, so results agree with the unfused path to bf16 rounding, not bit for bit.

Programs walk the grid M-fastest: the programs that share one weight tile run together,
so each weight byte comes from HBM once and from L2 for the other row tiles.  The plan
(:func:`gate_up_silu_plan`) depends only on shapes, so a CUDA graph and an eager run of
one batch size take the same path.  ``PAGEDLLM_GATE_UP_SILU=0`` keeps cuBLAS + the
separate activation (A/B runs).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.paged_attention import _interpreting


class GemmPlan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    tma: bool = False  # operands through TMA tensor descriptors (Hopper) vs pointers


# Rows at or below which the fused kernel is used (above it cuBLAS's large-M kernels and
# the separate activation, whose cost is then a small share).  Set from the H200 sweep
# (benchmarks/gemm_silu_ab.py, docs/benchmarks.md).
MAX_FUSED_ROWS = 1024
DEFAULT_PLAN = GemmPlan(128, 128, 64, 4, 8)


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    # The interpreter's 16-bit tl.dot returns garbage (triton 3.6, see paged_attention's
    # _mma); upcasting is exact, so its results match the GPU's MMA.
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, inter, stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                         F32_DOT: tl.constexpr):
    # K_TILES (= K / BLOCK_K, fixed per model) is a constexpr: a constant trip count is
    # pipelined on the GPU and is a plain range() under the interpreter.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M read row 0 (always valid) instead of a masked load, which keeps the
    # loads unmasked and vectorised; their results are never stored.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(K_TILES):
        a = tl.load(x_ptrs)
        acc_g = _dot(a, tl.trans(tl.load(g_ptrs)), acc_g, F32_DOT)
        acc_u = _dot(a, tl.trans(tl.load(u_ptrs)), acc_u, F32_DOT)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype)
    out = act.to(tl.float32) * acc_u.to(dtype).to(tl.float32)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out.to(dtype), mask=(offs_m < M)[:, None])


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_tma_kernel(x_desc, w_desc, out_ptr, M, inter, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                         F32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):  # rows past M arrive as zeros (descriptor bounds)
        k = i * BLOCK_K
        a = x_desc.load([m0, k])
        acc_g = _dot(a, w_desc.load([n0, k]).T, acc_g, F32_DOT)
        acc_u = _dot(a, w_desc.load([inter + n0, k]).T, acc_u, F32_DOT)
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype)
    out = act.to(tl.float32) * acc_u.to(dtype).to(tl.float32)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out.to(dtype), mask=(offs_m < M)[:, None])


def _enabled() -> bool:
    return os.environ.get("PAGEDLLM_GATE_UP_SILU", "1") != "0"


def _default_plan() -> GemmPlan:
    """``DEFAULT_PLAN``, or ``PAGEDLLM_GATE_UP_SILU_PLAN="BM,BN,BK,stages,warps,tma"``
    (benchmark sweeps)."""
    spec = os.environ.get("PAGEDLLM_GATE_UP_SILU_PLAN")
    if not spec:
        return DEFAULT_PLAN
    bm, bn, bk, stages, warps, tma = (int(v) for v in spec.split(","))
    return GemmPlan(bm, bn, bk, stages, warps, bool(tma))


def gate_up_silu_plan(x: torch.Tensor, weight: torch.Tensor) -> GemmPlan | None:
    """The plan for ``x [T, K]`` and the fused ``weight [2I, K]``, or ``None`` where the
    fused kernel does not apply (CPU, fp32, ragged shapes, more than ``MAX_FUSED_ROWS``
    rows, or switched off).  Shapes and dtypes only, never data."""
    plan = _default_plan()
    if not (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and weight.is_contiguous() and _enabled()):
        return None
    inter = weight.shape[0] // 2
    max_rows = int(os.environ.get("PAGEDLLM_GATE_UP_SILU_MAX_ROWS", MAX_FUSED_ROWS))
    if not (0 < x.shape[0] <= max_rows) or x.shape[1] != weight.shape[1] \
            or inter % plan.block_n or x.shape[1] % plan.block_k:
        return None
    return plan


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan = DEFAULT_PLAN,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x W[:I]^T) * (x W[I:]^T)`` for ``x [T, K]`` (rows may be strided, last dim
    contiguous) and ``weight [2I, K]`` contiguous; returns ``[T, I]`` in ``x``'s dtype
    (written into ``out`` when given: contiguous ``[T, I]``).
    Requires ``I % plan.block_n == 0`` and ``K % plan.block_k == 0`` (see
    :func:`gate_up_silu_plan`)."""
    m, k = x.shape
    inter = weight.shape[0] // 2
    if inter % plan.block_n or k % plan.block_k or weight.shape[1] != k:
        raise ValueError(f"gate_up_silu: shapes x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)} do not fit plan {plan}")
    if out is None:
        out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, plan.block_m) * (inter // plan.block_n),)
    if plan.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [plan.block_m, plan.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [plan.block_n, plan.block_k])
        _gate_up_silu_tma_kernel[grid](
            x_desc, w_desc, out, m, inter, out.stride(0), BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, K_TILES=k // plan.block_k,
            F32_DOT=_interpreting(),
            num_stages=plan.num_stages,
            num_warps=plan.num_warps)
        return out
    _gate_up_silu_kernel[grid](
        x, weight, out, m, inter, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        K_TILES=k // plan.block_k, F32_DOT=_interpreting(),
        num_stages=plan.num_stages, num_warps=plan.num_warps)
    return out
