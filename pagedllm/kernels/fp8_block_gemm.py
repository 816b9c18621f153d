"""Block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 ``weight_block_size`` checkpoints) and
the per-token-group activation quantiser that feeds it.

```
 x  [M, K] bf16/fp16/fp32 --per (row, group of G columns) amax / 448--> x_q, x_s
 x_q [M, K]       e4m3, rows contiguous   x_s [M, ceil(K / G)]       fp32
 w_q [N, K]       e4m3, rows contiguous   w_s [ceil(N / BN), ceil(K / G)] fp32
                                           (a checkpoint's weight_scale_inv: w ~= w_q * w_s)
 out[m, n] = sum_g x_s[m, g] * w_s[n // BN, g] * sum_{k in group g} x_q[m, k] * w_q[n, k]
             (+ bias[n])                                        out [M, N] bf16 / fp16
```

``G`` (the weight block's column count, 128 in every released checkpoint) is also the
kernel's K step, so each step's ``tl.dot`` starts from zero and its fp32 result is scaled
by one activation scale per row and one weight scale per column before it is added to
the accumulator: the promotion of Hopper's reduced-precision FP8 wgmma sums happens
every 128 products, as in DeepSeek-V3's kernels (no ``max_num_imprecise_acc`` needed).
K and N need not be multiples of anything: the last K group and the last N tile are
masked (zero operands), and a weight block row ``BN`` need not match the tile.

Grid: ``(ceil(M / BLOCK_M) * ceil(N / BLOCK_N), split)``, N-major (``nmajor_tile``: the
programs of a weight tile run together and the other row tiles find it in L2).  Small M
(decode) leaves few output tiles, so K is split into whole groups; the fp32 partials
``[split, M, N]`` are added in a fixed order by ``int8_gemm.splitk_reduce``
(deterministic, graph-safe: the split is a function of host shapes).  ``SWAP`` computes
``acc^T = w @ x^T`` so that a handful of rows is wgmma's N dimension (8 to 256) rather
than an M padded to 64, as ``kernels/fp8_gemm.py`` does.

Under ``TRITON_INTERPRET=1`` the fp8 ``tl.dot`` runs (triton 3.6's interpreter upcasts
e4m3 exactly; checked by the tests), so the kernel needs no interpreter branch; the
quantiser rounds to e4m3 by hand there (``fp8_quant.round_e4m3``: the interpreter's
fp32 -> fp8 cast rounds wrongly), as the per-token quantiser does.

The torch references (:func:`quantize_fp8_groups_ref`, :func:`fp8_block_gemm_ref`) are
the oracles and the CPU path: they dequantise the same e4m3 operands and multiply in
fp32, so the kernel differs only by accumulation order (and the output's rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fp8_quant import round_e4m3
from pagedllm.kernels.int8_gemm import nmajor_tile, split_k_chunk, splitk_reduce
from pagedllm.kernels.quant_common import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

# (block_m, block_n, warps, stages, split_k, swap); the K step is the scale group.
Fp8BlockConfig = tuple[int, int, int, int, int, int]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- references


def quantize_fp8_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] e4m3, scale [M, ceil(K / group)] fp32)``: per row and
    group of ``group`` columns (the last one may be short), ``scale = max(amax / 448,
    FP8_MIN_SCALE)`` and ``q = x / scale`` rounded to e4m3 -- ``quantize_fp8_rows``'s
    rule, per group."""
    m, k = x.shape
    ng = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - k)).view(m, ng, group)
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, ng * group)[:, :k].contiguous(), scale


def dequantize_fp8_blocks(w_q: torch.Tensor, w_s: torch.Tensor,
                          block: tuple[int, int]) -> torch.Tensor:
    """``w_q [N, K]`` e4m3 with ``w_s [ceil(N / bn), ceil(K / bk)]`` -> fp32 ``[N, K]``
    (also dequantises activations: ``block = (1, group)``)."""
    bn, bk = block
    n, k = w_q.shape
    full = w_s.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w_q.float() * full


def fp8_block_gemm_ref(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor,
                       w_s: torch.Tensor, block: tuple[int, int],
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The oracle of :func:`fp8_block_gemm` (module doc): both operands dequantised, one
    fp32 matmul.  ``block = (bn, bk)``: the weight block; activations use groups of
    ``bk``."""
    x = dequantize_fp8_blocks(x_q, x_s, (1, block[1]))
    y = x @ dequantize_fp8_blocks(w_q, w_s, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# --------------------------------------------------------------------------- quantiser


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, min_scale,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                        FP8_MAX_C: tl.constexpr):
    # A [GROUPS_PER_PROG, GROUP] tile of one row: each group's amax is a row reduction.
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), FP8_MAX_C), min_scale)
    q = round_e4m3(tl.div_rn(x, scale[:, None]))  # IEEE division, as torch divides
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * GROUP < K)


def quantize_fp8_groups(x: torch.Tensor, group: int = 128,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`quantize_fp8_groups_ref` (same values): ``x [M, K]`` (last dim
    contiguous) -> ``(q [M, K] e4m3, scale [M, ceil(K / group)] fp32)``.  ``group``: a
    power of two.  One program per row and 16 groups (2,048 columns at 128)."""
    if x.dim() != 2 or x.stride(1) != 1 or group & (group - 1):
        raise ValueError(f"quantize_fp8_groups: x {tuple(x.shape)} (last dim contiguous) "
                         f"and a power-of-two group, got {group}")
    m, k = x.shape
    ng = -(-k // group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    per = min(16, triton.next_power_of_2(ng))
    _group_quant_kernel[(m, triton.cdiv(ng, per))](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0), FP8_MIN_SCALE, GROUP=group,
        GROUPS_PER_PROG=per, FP8_MAX_C=FP8_MAX, num_warps=4)
    return q, s


# --------------------------------------------------------------------------- GEMM


@triton.jit
def _group_step(acc, g, K, x_ptrs, w_ptrs, xs_ptr, ws_ptr, x_rows, ws_rows, stride_xsm,
                stride_wsn, rk, GROUP: tl.constexpr, SWAP: tl.constexpr):
    """K group ``g``: one FP8 ``tl.dot`` from zero, scaled per row and column into the
    fp32 ``acc`` (columns past ``K`` load as zeros; a group past ``K`` adds nothing)."""
    k_ok = (g * GROUP + rk) < K
    g_ok = g * GROUP < K
    x = tl.load(x_ptrs + g * GROUP, mask=k_ok[None, :], other=0.0)
    w = tl.load(w_ptrs + g * GROUP, mask=k_ok[None, :], other=0.0)
    xs = tl.load(xs_ptr + x_rows * stride_xsm + g, mask=g_ok, other=0.0)
    ws = tl.load(ws_ptr + ws_rows * stride_wsn + g, mask=g_ok, other=0.0)
    if SWAP:
        part = tl.dot(w, tl.trans(x))  # from zero: promoted to fp32 every group
        return acc + part * ws[:, None] * xs[None, :]
    else:
        part = tl.dot(x, tl.trans(w))
        return acc + part * xs[:, None] * ws[None, :]


@triton.jit
def _fp8_block_gemm_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                           stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
                           stride_os, groups_per_split,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           GROUP: tl.constexpr, W_BLOCK_N: tl.constexpr,
                           SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                           WHILE_LOOP: tl.constexpr):
    pid_k = tl.program_id(1)
    rm, rn, m_ok, n_ok = nmajor_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = tl.minimum(rm, M - 1).to(tl.int64)  # out-of-range rows re-read row M - 1
    w_rows = tl.minimum(rn, N - 1).to(tl.int64)
    ws_rows = w_rows // W_BLOCK_N  # each output column's weight block row
    rk = tl.arange(0, GROUP)
    x_ptrs = xq_ptr + x_rows[:, None] * stride_xm + rk[None, :]
    w_ptrs = wq_ptr + w_rows[:, None] * stride_wn + rk[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g0 = pid_k * groups_per_split
    # The trip count is a launch argument, not a constexpr: one compiled kernel serves
    # every K and split of a tile shape.  The last split may run past K in whole groups,
    # masked here: zero operands and a zero scale add nothing.
    if WHILE_LOOP:
        # The interpreter cannot take scalar arguments as range() bounds (numpy 2
        # refuses int() of their shape-(1,) arrays); on the GPU the for-loop stays, as
        # only scf.for loops are software-pipelined (num_stages).
        i = 0
        while i < groups_per_split:
            acc = _group_step(acc, g0 + i, K, x_ptrs, w_ptrs, xs_ptr, ws_ptr, x_rows,
                              ws_rows, stride_xsm, stride_wsn, rk, GROUP, SWAP)
            i += 1
    else:
        for i in range(0, groups_per_split):
            acc = _group_step(acc, g0 + i, K, x_ptrs, w_ptrs, xs_ptr, ws_ptr, x_rows,
                              ws_rows, stride_xsm, stride_wsn, rk, GROUP, SWAP)
    if SWAP:
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
        ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os
                + rm.to(tl.int64)[None, :] * stride_om + rn[:, None])
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
        ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os
                + rm.to(tl.int64)[:, None] * stride_om + rn[None, :])
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def default_block_config(m: int, n: int, k: int, group: int = 128,
                         sm_count: int = 132) -> Fp8BlockConfig:
    """A launch configuration from host ints only (not tuned; the benchmark
    ``benchmarks/mla_fp8_bench.py --sweep`` prints the best of a grid per shape).

    Up to 64 rows: rows as wgmma's N (``SWAP``), 64-column weight tiles, and K split
    into whole groups until about two waves of ``sm_count`` programs run (a decode's
    N / 64 tiles alone leave most SMs idle).  More rows: 64 x 128 tiles, split only
    while under one wave."""
    groups = -(-k // group)
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        bn, warps, stages, swap = 64, 4, 4, 1
    else:
        # 64 x 128 at 4 warps (vLLM's default for this GEMM): 128 x 128 at 8 warps took
        # 255 registers on sm_90 and spilled once split (ptxas, triton 3.6).
        bm, bn, warps, stages, swap = 64, 128, 4, 3, 0
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    if tiles < sm_count:
        split = max(1, min(groups // 2, -(-2 * sm_count // tiles), 16))
    return (bm, bn, warps, stages, split, swap)


def fp8_block_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor,
                   w_s: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
                   out_dtype: torch.dtype,
                   config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` (module doc).  ``block = (bn, bk)``: the weight block
    (``weight_block_size``); ``bk`` is also the activation group and must be a power of
    two >= 16.  ``x_s [M, ceil(K / bk)]`` and ``w_s [ceil(N / bn), ceil(K / bk)]`` fp32
    (any row stride, columns contiguous).  ``config``: a launch by hand (else
    :func:`default_block_config`).  ``ValueError`` on operands of the wrong dtype or
    shape."""
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x_q {tuple(x_q.shape)} and w_q {tuple(w_q.shape)}: expected "
                         "[M, K] and [N, K]")
    if x_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"x_q, w_q: expected float8_e4m3fn, got {x_q.dtype}, {w_q.dtype}")
    m, k = x_q.shape
    n = w_q.shape[0]
    bn_w, group = block
    ng = -(-k // group)
    if group < 16 or group & (group - 1):
        raise ValueError(f"fp8_block_gemm: weight block columns {group} must be a power "
                         "of two >= 16")
    if tuple(x_s.shape) != (m, ng) or tuple(w_s.shape) != (-(-n // bn_w), ng):
        raise ValueError(f"fp8_block_gemm: scales x_s {tuple(x_s.shape)}, w_s "
                         f"{tuple(w_s.shape)}; expected {(m, ng)} and {(-(-n // bn_w), ng)}")
    if x_q.stride(1) != 1 or w_q.stride(1) != 1 or x_s.stride(1) != 1 or w_s.stride(1) != 1:
        raise ValueError("fp8_block_gemm: operands and scales need contiguous rows")
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        sm = 132
        if x_q.is_cuda and not _interpreting():
            from pagedllm.kernels.paged_attention import device_sm_count

            sm = device_sm_count(x_q.device)
        config = default_block_config(m, n, k, group, sm)
    bm, bn, warps, stages, split, swap = config
    k_chunk, split = split_k_chunk(k, group, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x_q.device)
    _fp8_block_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), split)](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, target, m, n, k,
        x_q.stride(0), x_s.stride(0), w_q.stride(0), w_s.stride(0), n,
        m * n if split > 1 else 0, k_chunk // group,
        BLOCK_M=bm, BLOCK_N=bn, GROUP=group, W_BLOCK_N=bn_w,
        SWAP=bool(swap), HAS_BIAS=bias is not None, WHILE_LOOP=_interpreting(),
        num_warps=warps, num_stages=stages)
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None,
                     config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T + bias`` in ``x``'s dtype: ``x`` quantised per token and
    group of ``block[1]`` columns, then the block-scaled GEMM -- Triton on CUDA (and under
    the interpreter), the torch references on the CPU."""
    if x.is_cuda or _interpreting():
        x_q, x_s = quantize_fp8_groups(x, block[1])
        return fp8_block_gemm(x_q, x_s, w_q, w_s, block, bias, x.dtype, config)
    x_q, x_s = quantize_fp8_groups_ref(x, block[1])
    return fp8_block_gemm_ref(x_q, x_s, w_q, w_s, block, bias, x.dtype)
