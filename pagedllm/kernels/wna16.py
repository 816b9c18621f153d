"""INT4/INT8 weight-only GEMM (W4A16, W8A16) with fp16/bf16 activations, dequantising
inside the GEMM, and the torch reference that is its oracle.

The canonical layout every INT checkpoint format (compressed-tensors ``pack-quantized``,
GPTQ, AWQ) is converted to at load -- the only layout these kernels read:

* ``qweight: int32 [N, K * bits / 32]``: unsigned codes packed along K, little-endian in
  the word: the code of input ``k`` sits at bits ``(k % P) * bits`` of word ``k // P``,
  ``P = 32 / bits`` (8 codes a word at 4 bits, 4 at 8 bits);
* ``scales: [N, ceil(K / G)]`` in the activation dtype (fp32 allowed);
* ``zeros: [N, ceil(K / G)]`` float, in code units, or None: symmetric, ``zero =
  2 ** (bits - 1)``;
* ``g_idx: int [K]`` or None: the group of input ``k`` (GPTQ act-order); None means
  ``k // G``.

``w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)]`` and the product is
``x @ w.T``, accumulated in fp32 and rounded once to ``x.dtype``.

One Triton kernel, two inner loops picked by a compile-time ``BLOCK_M``:

* ``BLOCK_M == 1`` (decode at one row): the GEMV of ``kernels/gemv.py`` -- each program
  owns ``BLOCK_N`` weight rows, dequantises a ``[BLOCK_N, BLOCK_K]`` tile in fp32 and
  accumulates elementwise FMAs, reduced along K once at the end;
* ``BLOCK_M >= 16`` (2..16 rows on one tile, and the tiled prefill path): the
  dequantised tile is rounded to ``x.dtype`` and fed to ``tl.dot`` with an fp32
  accumulator (tensor cores).

Each K step loads ``BLOCK_K / P`` words per row (each word once) and unpacks them with a
broadcast shift ``[BLOCK_N, BLOCK_K / P, P] -> [BLOCK_N, BLOCK_K]``.  The group scales
(and zeros) are gathered per k with ``g_idx``; without it they are loaded per group:
one per row when ``G`` is a multiple of ``BLOCK_K`` (the tile is in one group), one per
(row, group) broadcast over a ``[BLOCK_N, BLOCK_K / G, G]`` view when ``BLOCK_K`` is a
multiple of ``G``; other group sizes are gathered per k.

Split-K: at decode the output is too narrow to fill the GPU (``4096 / BLOCK_N`` programs
for ``o_proj``), so K is cut into ``split_k`` chunks; each program writes its fp32
partial sum to ``[split_k, M, N]`` and one torch ``sum`` adds them in a fixed order --
deterministic (no atomics), one extra small kernel.  The split depends only on the shape
(host ints), never on data: CUDA-graph safe, no host syncs.

``int8_gemm`` (W8A8-INT8: per-token int8 activations, per-channel int8 weights) and its
activation quantiser live in ``kernels/int8_gemm.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# W8A8-INT8 lives in its own module; re-exported so that one import serves both.
from pagedllm.kernels.int8_gemm import (  # noqa: F401
    int8_gemm,
    quant_per_token_int8,
    split_k_chunk,
    target_programs,
)

SUPPORTED_BITS = (4, 8)
SMALL_M = 16  # rows up to which the decode configurations are used
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton runs on CPU tensors only in the interpreter; elsewhere the CPU gets the reference
# (the CPU's fast path is torch's packed-int4 kernels, layers/quantization/int4pack.py).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- layout


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [N, K]`` (integers in ``[0, 2**bits)``) -> ``int32 [N, K * bits / 32]``
    in the canonical layout (module doc).  ``K`` must be a multiple of ``32 / bits``."""
    _check_bits(bits)
    if codes.dim() != 2:
        raise ValueError(f"codes: expected [N, K], got shape {tuple(codes.shape)}")
    pack = 32 // bits
    n, k = codes.shape
    if k % pack:
        raise ValueError(f"codes: K={k} is not a multiple of {pack} ({bits}-bit codes "
                         "pack 32 / bits to an int32 word)")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"codes: values must lie in [0, {1 << bits}) for bits={bits}")
    shifts = torch.arange(pack, device=c.device, dtype=torch.int64) * bits
    words = (c.reshape(n, k // pack, pack) << shifts).sum(-1)  # disjoint bits: sum == or
    # Reinterpret the unsigned 32-bit word as int32 (two's complement).
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``int32 [N, K * bits / 32]`` -> unsigned codes ``int32 [N, K]`` (inverse of
    :func:`pack_codes`)."""
    _check_bits(bits)
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight: expected int32 [N, K*bits/32], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    # Arithmetic shift of a negative word fills with ones; the mask drops them.
    codes = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(qweight.shape[0], -1)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: {bits} is not supported (supported: {SUPPORTED_BITS})")


def _check_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bits: int,
                group_size: int) -> tuple[int, int, int]:
    """Validate the canonical layout against ``x``; returns ``(N, K, group_size)`` with a
    ``group_size`` of -1 (one group per row: channel-wise) resolved to ``K``."""
    _check_bits(bits)
    if x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected a float tensor [..., K], got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[-1]
    pack = 32 // bits
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight: expected int32 [N, K*bits/32], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n = qweight.shape[0]
    if k % pack or qweight.shape[1] != k // pack:
        raise ValueError(f"qweight: shape {tuple(qweight.shape)} does not hold K={k} "
                         f"{bits}-bit codes per row (K must be a multiple of {pack})")
    if group_size == -1:
        group_size = k
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size: expected a positive int or -1, got {group_size!r}")
    groups = -(-k // group_size)
    if scales.dim() != 2 or tuple(scales.shape) != (n, groups) \
            or scales.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"scales: expected float [{n}, {groups}] for K={k}, "
                         f"group_size={group_size}; got {scales.dtype} {tuple(scales.shape)}")
    if zeros is not None and (tuple(zeros.shape) != (n, groups) or not zeros.is_floating_point()):
        raise ValueError(f"zeros: expected float [{n}, {groups}] (code units) or None; "
                         f"got {zeros.dtype} {tuple(zeros.shape)}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype not in (torch.int32,
                                                                          torch.int64)):
        raise ValueError(f"g_idx: expected int32 [{k}] or None, got {g_idx.dtype} "
                         f"{tuple(g_idx.shape)}")
    return n, k, group_size


def wna16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bits: int,
              group_size: int) -> torch.Tensor:
    """The oracle: dequantise the whole weight in fp32 (module doc), ``x @ w.T`` in fp32,
    one rounding to ``x.dtype``.  Vectorised torch; any device.  ``x [..., K]`` ->
    ``[..., N]``."""
    n, k, group_size = _check_args(x, qweight, scales, zeros, g_idx, bits, group_size)
    w = dequantize(qweight, scales, zeros, g_idx, bits, group_size, k)
    out = x.reshape(-1, k).float() @ w.T
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, bits: int, group_size: int,
               k: int | None = None) -> torch.Tensor:
    """The canonical layout -> fp32 ``w [N, K]`` (``group_size`` -1: channel-wise)."""
    codes = unpack_codes(qweight, bits).float()
    k = codes.shape[1] if k is None else k
    if group_size == -1:
        group_size = k
    g = (g_idx.long() if g_idx is not None
         else torch.arange(k, device=qweight.device) // group_size)
    zero = zeros.float()[:, g] if zeros is not None else float(1 << (bits - 1))
    return (codes - zero) * scales.float()[:, g]


# --------------------------------------------------------------------------- kernel


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, gi_ptr, rows, k0, K, stride_qn, stride_sn,
                  stride_zn, BITS: tl.constexpr, GROUP: tl.constexpr,
                  HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``w[rows, k0:k0 + BLOCK_K]``; columns past K come out as 0 (their x is 0
    too: the ragged last tile)."""
    PACK: tl.constexpr = 32 // BITS
    rw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(qw_ptr + rows[:, None] * stride_qn + rw[None, :],
                    mask=(rw < K // PACK)[None, :], other=0)
    shifts = tl.arange(0, PACK) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.float32)
    rk = k0 + tl.arange(0, BLOCK_K)
    k_ok = rk < K
    # One branch per scale layout, all compile-time; a single return (no early return
    # from inside a branch).
    if not HAS_GIDX and BLOCK_K % GROUP == 0 and BLOCK_K > GROUP:
        # The tile holds whole groups: one scale per (row, group), broadcast over the
        # group's codes through a [BLOCK_N, groups, GROUP] view.
        NG: tl.constexpr = BLOCK_K // GROUP
        gs = k0 // GROUP + tl.arange(0, NG)
        g_ok = (gs * GROUP < K)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_sn + gs[None, :], mask=g_ok,
                    other=0.0).to(tl.float32)[:, :, None]
        if HAS_ZERO:
            z = tl.load(z_ptr + rows[:, None] * stride_zn + gs[None, :], mask=g_ok,
                        other=0.0).to(tl.float32)[:, :, None]
        else:
            z = 1 << (BITS - 1)
        w = tl.reshape((tl.reshape(codes, (BLOCK_N, NG, GROUP)) - z) * s,
                       (BLOCK_N, BLOCK_K))
    elif not HAS_GIDX and GROUP % BLOCK_K == 0:
        # The tile lies in one group: one scale (and zero) per row.
        g = k0 // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)[:, None]
        else:
            z = 1 << (BITS - 1)
        w = (codes - z) * s
    else:
        # Any other group size, or act-order: the group of every input, gathered.
        if HAS_GIDX:
            g = tl.load(gi_ptr + rk, mask=k_ok, other=0)
        else:
            g = rk // GROUP
        s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=k_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rows[:, None] * stride_zn + g[None, :],
                        mask=k_ok[None, :], other=0.0).to(tl.float32)
        else:
            z = 1 << (BITS - 1)
        w = (codes - z) * s
    return w


@triton.jit
def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gi_ptr, out_ptr, M, N, K,
                  stride_xm, stride_qn, stride_sn, stride_zn, stride_om, stride_os,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HAS_GIDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # N-major order: the programs of one weight tile run together, so the tile is read
    # from HBM once and the other row tiles find it in L2 (x is small enough to stay).
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m
    pid_m = pid % num_m
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    # Out-of-range rows re-read row N-1 (never stored) so that weight loads need no row
    # mask, as in kernels/gemv.py.
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    # K_CHUNK is compile-time, so the K loop has a static trip count (and the
    # interpreter, which cannot take runtime range() bounds, runs it).  The last split
    # may run past K: its extra tiles are fully masked.
    k_start = pid_k * K_CHUNK
    out_base = out_ptr + pid_k.to(tl.int64) * stride_os
    if BLOCK_M == 1:
        # GEMV: elementwise fp32 FMAs on the dequantised tile, one reduction at the end.
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kt in range(0, K_CHUNK, BLOCK_K):
            k0 = k_start + kt
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, gi_ptr, rows, k0, K, stride_qn,
                              stride_sn, stride_zn, BITS, GROUP, HAS_ZERO, HAS_GIDX,
                              BLOCK_N, BLOCK_K)
            rk = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            acc += w * xk[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(out_base + pid_m.to(tl.int64) * stride_om + rn,
                 out.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, K_CHUNK, BLOCK_K):
            k0 = k_start + kt
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, gi_ptr, rows, k0, K, stride_qn,
                              stride_sn, stride_zn, BITS, GROUP, HAS_ZERO, HAS_GIDX,
                              BLOCK_N, BLOCK_K)
            rk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                         other=0.0)
            wt = tl.trans(w.to(xt.dtype))
            if IEEE:
                # fp32 activations (reference use): no tf32 rounding.  Also bf16 in the
                # interpreter, whose bf16 dot is wrong (numpy has no bf16): the operands
                # are already bf16 values, so an fp32 dot of them is what the tensor
                # cores compute (exact products, fp32 sums).
                acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(xt, wt, acc)
        tl.store(out_base + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


WNA16Config = tuple[int, int, int, int, int, int]  # block_m, block_n, block_k, warps,
# stages, split_k


def wna16_config(m: int, n: int, k: int, bits: int, group_size: int,
                 device: torch.device) -> WNA16Config:
    """``(block_m, block_n, block_k, num_warps, num_stages, split_k)`` by row count.

    Not tuned on a GPU yet (no device in the session that wrote it; the kernel bench's
    ``quant`` section is the place): block shapes follow the usual Triton W4A16 kernels,
    and ``block_k`` is a multiple or a divisor of the common group size 128 so that
    scales are loaded per group, not gathered per input.  ``split_k`` raises the
    program count to about two per SM.  Each configuration compiles for sm_90 without
    register spills (``tests/kernels/test_quant_gemm_sm90.py``)."""
    if m == 1:  # kernels/gemv.py's shape: 8 rows of 512 inputs a step
        bm, bn, bk, warps, stages = 1, 8, 512, 4, 2
    elif m <= SMALL_M:  # block_k 128 spills with zero points (ptxas, sm_90)
        bm, bn, bk, warps, stages = 16, 64, 64, 4, 3
    elif m <= 32:
        bm, bn, bk, warps, stages = 32, 64, 64, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 64, 128, 64, 8, 3
    programs = -(-m // bm) * -(-n // bn)
    k_tiles = -(-k // bk)
    split = max(1, min(target_programs(device) // programs, k_tiles, 16))
    return bm, bn, bk, warps, stages, split


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bits: int,
               group_size: int, config: WNA16Config | None = None) -> torch.Tensor:
    """``x [..., K]`` (fp16/bf16; fp32 allowed) times the canonical-layout weight (module
    doc) -> ``[..., N]`` in ``x.dtype``, accumulated in fp32.  ``group_size`` -1 means
    one group per row.  ``config`` overrides :func:`wna16_config` (tests, tuning).

    On a CPU tensor outside the Triton interpreter this is :func:`wna16_ref`.  Bad
    shapes or dtypes raise ValueError naming the argument."""
    n, k, group_size = _check_args(x, qweight, scales, zeros, g_idx, bits, group_size)
    if not x.is_cuda and not _INTERPRET:
        return wna16_ref(x, qweight, scales, zeros, g_idx, bits, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if qweight.stride(1) != 1 or scales.stride(1) != 1 or \
            (zeros is not None and zeros.stride(1) != 1):
        raise ValueError("qweight, scales, zeros: rows must be contiguous")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros),
                    ("g_idx", g_idx)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}")
    bm, bn, bk, warps, stages, split = config or wna16_config(m, n, k, bits, group_size,
                                                              x.device)
    if bk % (32 // bits) or bk & (bk - 1):
        raise ValueError(f"config: block_k={bk} must be a power of two >= {32 // bits}")
    if bm & (bm - 1) or 1 < bm < 16:
        raise ValueError(f"config: block_m={bm} must be 1 or a power of two >= 16")
    k_chunk, split = split_k_chunk(k, bk, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    grid = (-(-m // bm) * -(-n // bn), split)
    _wna16_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales,
        g_idx if g_idx is not None else qweight, target, m, n, k,
        x2.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, n, m * n if split > 1 else 0,
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None,
        HAS_GIDX=g_idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_CHUNK=k_chunk,
        IEEE=x.dtype == torch.float32 or (_INTERPRET and x.dtype == torch.bfloat16),
        num_warps=warps, num_stages=stages)
    if split > 1:
        out.copy_(target.sum(0))  # fixed order: deterministic
    return out.reshape(*lead, n)
