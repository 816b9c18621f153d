"""FP8 W8A8 GEMM with row-wise scales for decode-sized batches: a Triton kernel for the
rows where cuBLASLt's row-wise FP8 GEMM (``torch._scaled_mm`` with per-token and
per-channel scales) is slow.

```
 out[m, n] = (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m] * w_scale[n] (+ bias[n])
 x_q [M, K] e4m3, rows contiguous      x_scale [M, 1] fp32
 w_q [N, K] e4m3, rows contiguous      w_scale [N]    fp32        out [M, N] bf16 / fp16
```

Why: on the H200 cuBLASLt runs every row-wise FP8 product through one 128 x 128 tile
(``nvjet_sm90_qqtst_128x128``), whatever M is.  At 16 to 256 rows that leaves a
4096-wide output with 32 to 64 programs on 132 SMs, and the step reads its weights at
half the HBM rate: a Llama-3-8B layer's four projections took 103 us at 128 rows where
the same GEMM with per-tensor scales took 75 us (``docs/benchmarks.md``).  This kernel
fills the device by splitting K.

Design (as ``kernels/wna16_tc.py``, whose ``SWAP`` it shares): ``SWAP=True`` computes
``acc^T[BN, BM] = w[BN, BK] @ x^T[BK, BM]``, the rows being wgmma's N dimension (8 to
256, so 16 rows are not padded to 64); ``SWAP=False`` the plain ``acc[BM, BN]``.  Both
operands are K-major, as Hopper's FP8 wgmma needs.  The K loop accumulates in fp32 and
promotes wgmma's reduced-precision FP8 sums into it after every K step
(``max_num_imprecise_acc = BLOCK_K``, the promotion interval cuBLAS and DeepSeek-V3 use).
The epilogue scales the tile once in fp32.  Split-K partials (fp32 ``[split, M, N]``)
are added in a fixed order by ``int8_gemm.splitk_reduce``: deterministic, and
graph-safe (the split is a function of the shapes).

Which path a shape takes is a tuned table (``benchmarks/fp8_gemm_sweep.py`` writes it;
``kernels/tuned/fp8_gemm_<device>.json`` ships it; ``PAGEDLLM_FP8_GEMM_CONFIGS`` names
another): ``[m, n, k, "triton", [block_m, block_n, block_k, warps, stages, split, swap]]``
or ``[m, n, k, "cublas", null]``; an entry serves every M up to its ``m`` at that
``(n, k)``; beyond the table's largest ``m``, and for shapes or devices without a table,
cuBLASLt runs.  Only configurations the sweep checked on the GPU are routed to.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.int8_gemm import nmajor_tile, split_k_chunk, splitk_reduce
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start
from pagedllm.kernels.tuned_tables import load_tuned_table, table_path

# (block_m, block_n, block_k, warps, stages, split_k, swap)
Fp8GemmConfig = tuple[int, int, int, int, int, int, int]


@triton.jit
def _fp8_gemm_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_xm, stride_wn, stride_om, stride_os,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     K_CHUNK: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IMPRECISE: tl.constexpr, USE_PDL: tl.constexpr):
    pid_k = tl.program_id(1)
    rm, rn, m_ok, n_ok = nmajor_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = tl.minimum(rm, M - 1).to(tl.int64)  # out-of-range rows re-read row M - 1
    w_rows = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_CHUNK
    x_ptrs = xq_ptr + x_rows[:, None] * stride_xm + (k_start + rk)[None, :]
    w_ptrs = wq_ptr + w_rows[:, None] * stride_wn + (k_start + rk)[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl_start(USE_PDL)  # the weights need no wait; x is the previous kernel's output
    # K_CHUNK is whole BLOCK_K steps and K a multiple of BLOCK_K (the launcher checks);
    # the last split may run past K, in whole steps, masked here.
    for kt in range(0, K_CHUNK, BLOCK_K):
        k_ok = (k_start + kt + rk) < K
        w = tl.load(w_ptrs + kt, mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + kt, mask=k_ok[None, :], other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE)
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE)
    xs = tl.load(xs_ptr + x_rows)
    ws = tl.load(ws_ptr + w_rows)
    if SWAP:
        out = acc * ws[:, None] * xs[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                out += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
        ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os
                + rm.to(tl.int64)[None, :] * stride_om + rn[:, None])
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        out = acc * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                out += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
        ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os
                + rm.to(tl.int64)[:, None] * stride_om + rn[None, :])
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
             w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             config: Fp8GemmConfig) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` (module doc) with launch ``config``; ``K`` must be a
    multiple of its ``block_k`` (``ValueError`` otherwise, and for operands of the wrong
    dtype or shape)."""
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x_q {tuple(x_q.shape)} and w_q {tuple(w_q.shape)}: expected "
                         "[M, K] and [N, K]")
    if x_q.dtype != torch.float8_e4m3fn or w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_q, w_q: expected float8_e4m3fn, got {x_q.dtype}, {w_q.dtype}")
    m, k = x_q.shape
    n = w_q.shape[0]
    bm, bn, bk, warps, stages, split, swap = config
    if k % bk or x_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError(f"fp8_gemm: K = {k} must be a multiple of block_k = {bk}, with "
                         "rows contiguous")
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    k_chunk, split = split_k_chunk(k, bk, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x_q.device)
    _fp8_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), split)](
        x_q, x_scale.reshape(-1), w_q, w_scale.reshape(-1),
        bias if bias is not None else w_scale, target, m, n, k,
        x_q.stride(0), w_q.stride(0), n, m * n if split > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_CHUNK=k_chunk, SWAP=bool(swap),
        HAS_BIAS=bias is not None, IMPRECISE=bk, num_warps=warps, num_stages=stages,
        **pdl_launch_args(x_q.device))
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out


# --------------------------------------------------------------------------- routing


@functools.cache
def _table() -> dict[tuple[int, int], list[tuple[int, Fp8GemmConfig | None]]]:
    """``(n, k) -> [(m, config or None for cuBLASLt), ...]`` sorted by ``m``."""
    out: dict[tuple[int, int], list[tuple[int, Fp8GemmConfig | None]]] = {}
    for m, n, k, kind, cfg in load_tuned_table("fp8_gemm").get("configs", []):
        if kind not in ("triton", "cublas"):
            raise ValueError(f"PAGEDLLM_FP8_GEMM_CONFIGS: unknown path {kind!r}")
        conf = None if kind == "cublas" else tuple(int(v) for v in cfg)
        out.setdefault((int(n), int(k)), []).append((int(m), conf))  # type: ignore[arg-type]
    for v in out.values():
        v.sort(key=lambda e: e[0])
    return out


@functools.lru_cache(maxsize=4096)  # eager steps ask per layer
def fp8_gemm_route(m: int, n: int, k: int) -> Fp8GemmConfig | None:
    """The Triton configuration for ``m`` rows of an ``(n, k)`` weight, or None where
    cuBLASLt runs (module doc).  Host ints only: a graph capture and an eager run of one
    batch size pick the same path."""
    entries = _table().get((n, k))
    if not entries or m > entries[-1][0]:
        return None
    for tm, cfg in entries:
        if tm >= m:
            return cfg
    return None


def routing_summary() -> str:
    """One line for the start-up log: where this GPU's FP8 GEMMs run."""
    table = _table()
    if not table:
        return "FP8 GEMMs: cuBLASLt from 2 rows (no Triton FP8 GEMM table for this GPU)"
    src = table_path("fp8_gemm") or ""
    top = max((m for entries in table.values() for m, cfg in entries if cfg is not None),
              default=0)
    return (f"FP8 GEMMs: Triton up to {top} rows at {len(table)} weight shapes "
            f"({os.path.basename(src)}), cuBLASLt otherwise")
