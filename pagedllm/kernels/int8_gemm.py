"""W8A8-INT8 GEMM: per-token int8 activations times per-channel int8 weights, and the
per-token activation quantiser, with the torch references that are their oracles.

``out[m, n] = (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m] * w_scale[n]``: the integer dot
is exact in int32, then one fp32 scaling and one rounding to ``out_dtype``.

Paths (picked from shapes and the device only -- host ints, no data, no sync):

* ``torch._int_mm`` (cuBLASLt int8 GEMM) where CUDA takes it: more than 16 rows, K and N
  multiples of 8.  Its int32 result is scaled and rounded by one Triton epilogue pass
  (torch's ``acc.float() * xs * ws`` would be three launches over ``[M, N]``).
* a Triton kernel otherwise (decode: up to 16 rows; odd shapes): ``tl.dot`` of int8
  tiles into an int32 accumulator, the scales in the epilogue, split-K like
  ``kernels/wna16.py`` (fp32 partials summed by torch in a fixed order).

``quant_per_token_int8``: ``scale[t] = max(amax|x[t]| / 127, min)``, ``q = round(x /
scale)`` (half to even, as ``torch.round``), clamped to ``[-128, 127]``; one program per
row, as ``kernels/fp8_quant.py``.  On a CPU tensor outside the Triton interpreter every
function here is its torch reference.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedllm.kernels.fp8_quant import row_absmax
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# A floor on the activation scale: an all-zero token quantises to zeros instead of 0/0.
INT8_MIN_SCALE = 1e-10


@cache
def target_programs(device: torch.device) -> int:
    """Programs that fill the device: two per SM (a small fixed number in the
    interpreter, where every program costs time)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def split_k_chunk(k: int, block_k: int, split: int) -> tuple[int, int]:
    """``(k_chunk, split)``: whole K steps per split, and the split count without
    empty splits."""
    k_chunk = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    return k_chunk, triton.cdiv(k, k_chunk)


def _triton_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


# --------------------------------------------------------------------------- references


def quant_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]`` -> ``(q int8 [T, C], scale fp32 [T, 1])`` (module doc)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=INT8_MIN_SCALE)
    q = torch.round(xf / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def int8_gemm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                  w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The oracle: exact integer dot products (in fp64, exact below 2**53: CUDA has no
    integer matmul), fp32 scaling, one rounding."""
    acc = (x_q.double() @ w_q.double().T).float()
    return (acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
            ).to(out_dtype)


def _check_int8_args(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype) -> tuple[int, int, int]:
    if x_q.dim() != 2 or x_q.dtype != torch.int8:
        raise ValueError(f"x_q: expected int8 [M, K], got {x_q.dtype} {tuple(x_q.shape)}")
    m, k = x_q.shape
    if w_q.dim() != 2 or w_q.dtype != torch.int8 or w_q.shape[1] != k:
        raise ValueError(f"w_q: expected int8 [N, {k}], got {w_q.dtype} {tuple(w_q.shape)}")
    n = w_q.shape[0]
    if x_scale.dtype != torch.float32 or x_scale.numel() != m:
        raise ValueError(f"x_scale: expected fp32 [{m}, 1], got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.numel() != n:
        raise ValueError(f"w_scale: expected fp32 [{n}], got {w_scale.dtype} "
                         f"{tuple(w_scale.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected fp16, bf16 or fp32, got {out_dtype}")
    return m, n, k


# --------------------------------------------------------------------------- quantiser


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, min_scale,
                       N_COLS: tl.constexpr, BLOCK: tl.constexpr,
                       ROUND_BY_HAND: tl.constexpr, CT: tl.constexpr = False,
                       USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = row_absmax(x_ptr, row, stride_x, N_COLS, BLOCK)
    if CT:
        # compressed-tensors' arithmetic in x's dtype (int8_w8a8.quantize_int8_per_token):
        # scale = amax / 127.5 rounded to the dtype; a zero scale becomes the dtype's eps
        # (min_scale); x / scale rounded to the dtype before round-and-clamp.
        xdt = x_ptr.dtype.element_ty
        scale = tl.div_rn(amax, 127.5).to(xdt).to(tl.float32)
        scale = tl.where(scale == 0.0, min_scale, scale)
    else:
        scale = tl.maximum(tl.div_rn(amax, 127.0), min_scale)
    tl.store(s_ptr + row, scale)
    for start in range(0, N_COLS, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < N_COLS, other=0.0).to(tl.float32)
        y = tl.div_rn(x, scale)  # IEEE division, as torch divides
        if CT:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        # Round half to even, as torch.round.  The interpreter has no libdevice: there,
        # |y| <= 127 (plus a rounding), so adding 1.5 * 2**23 leaves a spacing of 1 and
        # the addition itself rounds.
        if ROUND_BY_HAND:
            y = (y + 12582912.0) - 12582912.0
        else:
            y = libdevice.rint(y)
        q = tl.clamp(y, -128.0, 127.0)
        tl.store(q_ptr + row * stride_q + c, q.to(tl.int8), mask=c < N_COLS)


def quant_per_token_int8(x: torch.Tensor, compressed_tensors: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]`` (float, last dim contiguous) -> ``(q int8 [T, C], scale fp32
    [T, 1])``, equal to :func:`quant_per_token_int8_ref` (module doc).  With
    ``compressed_tensors`` the arithmetic is the library's (``amax / 127.5`` and the
    division rounded to ``x.dtype``, a zero scale replaced by the dtype's eps), equal to
    ``layers/quantization/int8_w8a8.quantize_int8_per_token``: one launch instead of
    torch's chain of eight."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected a float [T, C] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not _triton_ok(x):
        if compressed_tensors:
            from pagedllm.kernels.quant_common import quantize_int8_per_token

            return quantize_int8_per_token(x)
        return quant_per_token_int8_ref(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    t, c = x.shape
    q = torch.empty((t, c), dtype=torch.int8, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    min_scale = torch.finfo(x.dtype).eps if compressed_tensors else INT8_MIN_SCALE
    if t == 0 or c == 0:
        return q, s.fill_(min_scale)
    block = min(4096, triton.next_power_of_2(c))
    _quant_int8_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), min_scale,
                             N_COLS=c, BLOCK=block, ROUND_BY_HAND=_INTERPRET,
                             CT=compressed_tensors, num_warps=8 if block >= 2048 else 4,
                             **pdl_launch_args(x.device))
    return q, s


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """``out = sum_i part[i]`` over ``[SPLIT, MN]`` fp32 partials, in index order."""
    pdl_start(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for i in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + i * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def splitk_reduce(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [M, N] = partials [split, M, N].sum(0)`` in a fixed order, one launch (torch's
    ``out.copy_(partials.sum(0))`` is two)."""
    split = partials.shape[0]
    mn = out.numel()
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(mn, block),)](
        partials, out, mn, SPLIT=split, BLOCK=block, num_warps=4,
        **pdl_launch_args(out.device))
    return out


# --------------------------------------------------------------------------- GEMM


@triton.jit
def nmajor_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(rows, cols, rows_ok, cols_ok)`` of this program's ``[BLOCK_M, BLOCK_N]`` output
    tile (axis 0 of the grid).  N-major order: the programs of one weight tile run
    together, so the tile is read from HBM once and the other row tiles find it in L2
    (x is small enough to stay)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@triton.jit
def _int8_gemm_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, out_ptr, M, N, K, stride_xm,
                      stride_wn, stride_om, stride_os, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_CHUNK: tl.constexpr):
    pid_k = tl.program_id(1)
    rm, rn, m_ok, n_ok = nmajor_tile(M, N, BLOCK_M, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # out-of-range rows re-read row N-1
    x_rows = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * K_CHUNK  # static trip count, as in kernels/wna16.py
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for kt in range(0, K_CHUNK, BLOCK_K):
        rk = k_start + kt + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(wq_ptr + rows[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None],
                    other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # exact integer sums
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + rows)
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    tl.store(out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om
             + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _scale_epilogue_kernel(acc_ptr, xs_ptr, ws_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """``out = acc * xs[:, None] * ws[None, :]`` for an int32 ``[M, N]`` (contiguous)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.load(acc_ptr + offs, mask=ok, other=0).to(tl.float32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + offs, (acc * xs[:, None] * ws[None, :]).to(out_ptr.dtype.element_ty),
             mask=ok)


def int_mm_applies(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether ``torch._int_mm`` takes these operands on their device (CUDA: more than 16
    rows, K and N multiples of 8)."""
    m, k = x_q.shape
    return x_q.is_cuda and m > 16 and k % 8 == 0 and w_q.shape[0] % 8 == 0


Int8Config = tuple[int, int, int, int, int, int]  # block_m, block_n, block_k, warps,
# stages, split_k


def int8_gemm_config(m: int, n: int, k: int, device: torch.device) -> Int8Config:
    """Launch configuration of the Triton path (not GPU-tuned yet: see the kernel
    bench's ``int8`` section).  int8 ``tl.dot`` needs 16+ rows and a K step of 32+."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    programs = -(-m // bm) * -(-n // bn)
    split = max(1, min(target_programs(device) // programs, -(-k // bk), 16))
    return bm, bn, bk, warps, stages, split


def int8_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype,
                     config: Int8Config | None = None) -> torch.Tensor:
    """The Triton path of :func:`int8_gemm` (any shape); ``config`` overrides
    :func:`int8_gemm_config`."""
    m, n, k = _check_int8_args(x_q, x_scale, w_q, w_scale, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if x_q.stride(1) != 1:
        x_q = x_q.contiguous()
    if w_q.stride(1) != 1:
        raise ValueError("w_q: rows must be contiguous")
    bm, bn, bk, warps, stages, split = config or int8_gemm_config(m, n, k, x_q.device)
    k_chunk, split = split_k_chunk(k, bk, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x_q.device)
    _int8_gemm_kernel[(-(-m // bm) * -(-n // bn), split)](
        x_q, x_scale.reshape(-1), w_q, w_scale.reshape(-1), target, m, n, k,
        x_q.stride(0), w_q.stride(0), n, m * n if split > 1 else 0, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, K_CHUNK=k_chunk, num_warps=warps,
        num_stages=stages)
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out


def int8_gemm_int_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``torch._int_mm`` path of :func:`int8_gemm` plus the Triton scale epilogue
    (also runs on the CPU, where torch has ``_int_mm`` too)."""
    m, n, _ = _check_int8_args(x_q, x_scale, w_q, w_scale, out_dtype)
    acc = torch._int_mm(x_q.contiguous(), w_q.t())  # [M, N] int32, exact
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if not _triton_ok(acc):
        out.copy_(acc.float() * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1))
        return out
    bm, bn = 32, 128
    _scale_epilogue_kernel[(-(-m // bm), -(-n // bn))](
        acc, x_scale.reshape(-1), w_scale.reshape(-1), out, m, n, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=4)
    return out


def int8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
              w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x_q int8 [M, K]``, ``x_scale fp32 [M, 1]``, ``w_q int8 [N, K]`` (rows
    contiguous), ``w_scale fp32 [N]`` -> ``[M, N]`` in ``out_dtype`` (module doc).
    Bad operands raise ValueError naming the argument."""
    _check_int8_args(x_q, x_scale, w_q, w_scale, out_dtype)
    if not _triton_ok(x_q):
        return int8_gemm_ref(x_q, x_scale, w_q, w_scale, out_dtype)
    if int_mm_applies(x_q, w_q):
        return int8_gemm_int_mm(x_q, x_scale, w_q, w_scale, out_dtype)
    return int8_gemm_triton(x_q, x_scale, w_q, w_scale, out_dtype)
