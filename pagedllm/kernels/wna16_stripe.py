"""INT4/INT8 weight-only GEMM on the *striped* GPU layout: a decode GEMV (elementwise
FMAs), a tensor-core tile (``tl.dot``) and a dequantise-to-bf16 kernel (for cuBLAS at
large M), with the torch helpers that convert to and from the layout.

Why a second layout.  The canonical layout (``kernels/wna16.py``) packs inputs
``8w .. 8w + 7`` into word ``w``; a kernel that unpacks a ``[BLOCK_N, W]`` tile of words
gets ``[BLOCK_N, W, 8]`` codes whose flattening to ``[BLOCK_N, 8W]`` (to meet ``x``) is
a register shuffle per step, and the int->float conversions run at a quarter of the FMA
rate.  The striped layout puts the inputs of each 128-wide *stripe* so that slot ``s``
of the stripe's words is a contiguous run of inputs:

```
 P = 32 / bits codes a word, S = 128 / P words a stripe (16 at 4 bits, 32 at 8 bits)
 word t * S + j of a row, slot s (bits s * bits)  holds the code of input  t * 128 + s * S + j
```

so slot ``s`` of a ``[BLOCK_N, J]`` word tile is already a ``[BLOCK_N, J]`` code tile in
the words' register layout, to be met by ``x[k0 + s * S + j]`` (runs of S contiguous
inputs): no reshape, each word loaded once, coalesced.  Scales and zeros stay
``[N, K / G]`` (``G`` a multiple of 128, or ``K``: one group per stripe or wider).

Unpacking without int->float conversions: the slots of the low half-word (``w``) and of
the high one (``w >> 16``) sit at bit offsets ``o < 16``; ``(h & (mask << o)) |
0x4B000000`` read as fp32 is ``2**23 + code * 2**o`` (the code lands in the mantissa),
and ``v * 2**-o - 2**(23 - o)`` (one FMA, exact) is the code.  A code costs a LOP3, an
FMA and the product's FMA, and the group scale is applied once per word.

Zero points leave the GEMV's inner loop: it runs the symmetric loop (``c - 2**(bits-1)``,
the bias folded into the constant) and adds, per stripe of the step, ``scale * (2**(bits-1)
- z) * sum(x over the stripe)`` to a ``[BLOCK_N]`` correction -- a few loads of L1-resident
``x`` and one ``[BLOCK_N, STRIPES]`` tile of scales and zeros per step, instead of an extra
operation on every code.  The tensor-core and dequantise kernels subtract ``z`` per code
(their cost per code is shared by many rows).

Contract: ``K`` a multiple of 128, group ``G`` a multiple of 128 or ``K``, no ``g_idx``
(act-order weights are permuted at load, ``layers/quantization/int_cuda.py``);
``w[n, k] = (code - zero) * scale`` exactly as the canonical layout, products accumulated
in fp32, one rounding to ``x.dtype``.  Split-K partials (fp32 ``[split, M, N]``) are added
in a fixed order by one reduce kernel: deterministic, graph-safe (shapes only).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.int8_gemm import split_k_chunk, splitk_reduce, target_programs
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start, pdl_trigger, pdl_wait
from pagedllm.kernels.tuned_tables import load_tuned_table, smallest_fit
from pagedllm.kernels.wna16 import pack_codes, unpack_codes

STRIPE = 128  # inputs per stripe
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- layout


def stripe_applies(bits: int, k: int, group_size: int, has_g_idx: bool) -> bool:
    """Whether a weight can take the striped layout (module doc)."""
    return (bits in (4, 8) and k % STRIPE == 0 and not has_g_idx
            and (group_size == k or group_size % STRIPE == 0))


def to_stripes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Canonical ``int32 [N, K * bits / 32]`` -> the striped layout, same shape."""
    p = 32 // bits
    codes = unpack_codes(qweight, bits)  # [N, K], k order
    n, k = codes.shape
    if k % STRIPE:
        raise ValueError(f"qweight: K={k} is not a multiple of {STRIPE}")
    s = STRIPE // p
    # [N, stripes, slot, j] (input t*128 + slot*S + j) -> [N, stripes, j, slot]: words
    # (t, j) with their P slots last, which pack_codes packs slot 0 first.
    c = codes.reshape(n, k // STRIPE, p, s).transpose(2, 3).reshape(n, k)
    return pack_codes(c.contiguous(), bits)


def from_stripes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`to_stripes`."""
    p = 32 // bits
    c = unpack_codes(qweight, bits)
    n, k = c.shape
    s = STRIPE // p
    codes = c.reshape(n, k // STRIPE, s, p).transpose(2, 3).reshape(n, k)
    return pack_codes(codes.contiguous(), bits)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _slot(w, hi, s: tl.constexpr, BITS: tl.constexpr, z=0.0):
    """fp32 ``code - z`` of slot ``s`` of the words ``w`` (``hi = w >> 16``), exact
    (``z`` a small integer: the bias ``2**(23 - OFF) + z`` is exact too)."""
    HALF: tl.constexpr = 16 // BITS
    OFF: tl.constexpr = (s % HALF) * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << OFF
    if s < HALF:
        h = w
    else:
        h = hi
    v = ((h & MASK) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + code * 2**OFF
    INV: tl.constexpr = 1.0 / (1 << OFF)
    BIAS: tl.constexpr = 8388608.0 / (1 << OFF)
    return v * INV - (BIAS + z)


@triton.jit
def _group_params(s_ptr, z_ptr, rows, k0, rj, stride_sn, stride_zn, J_OK: tl.constexpr,
                  j_ok,
                  BITS: tl.constexpr, GROUP: tl.constexpr, S: tl.constexpr,
                  HAS_ZERO: tl.constexpr):
    """``[BLOCK_N, J]`` fp32 scales and zeros of each word of the step (a word lies in
    one group: groups are whole stripes)."""
    g = (k0 + (rj // S) * 128) // GROUP
    offs = rows[:, None] * stride_sn + g[None, :]
    if J_OK:
        sc = tl.load(s_ptr + offs).to(tl.float32)
    else:
        sc = tl.load(s_ptr + offs, mask=j_ok[None, :], other=0.0).to(tl.float32)
    if HAS_ZERO:
        zoffs = rows[:, None] * stride_zn + g[None, :]
        if J_OK:
            z = tl.load(z_ptr + zoffs)
        else:
            z = tl.load(z_ptr + zoffs, mask=j_ok[None, :], other=0.0)
    else:
        z = tl.full(sc.shape, 1 << (BITS - 1), tl.float32)
    return sc, z


@triton.jit
def _load_words(qw_ptr, rows, k0, rj, stride_qn, J_OK: tl.constexpr, j_ok,
                BITS: tl.constexpr):
    kw = tl.multiple_of(k0 // (32 // BITS), 16)  # k0 is a multiple of 128
    offs = rows[:, None] * stride_qn + (kw + rj)[None, :]
    if J_OK:
        return tl.load(qw_ptr + offs)
    return tl.load(qw_ptr + offs, mask=j_ok[None, :], other=0)


@triton.jit
def _xrow(base, r: tl.constexpr, stride_xm, M, j_ok, J_OK: tl.constexpr):
    """Row ``r`` of this slot's ``x`` (fp32) through the broadcast pointers ``base``."""
    if r == 0 and J_OK:
        return tl.load(base).to(tl.float32)
    if r == 0:
        return tl.load(base, mask=j_ok[None, :], other=0.0).to(tl.float32)
    return tl.load(base + r * stride_xm, mask=j_ok[None, :] & (r < M),
                   other=0.0).to(tl.float32)


@triton.jit
def _gemv_step(x_ptr, w, sc, z, zrow, k0, xoff4, j_ok, stride_xm, M, a0, a1, a2, a3,
               BITS: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr,
               J_OK: tl.constexpr):
    """``a_r [BLOCK_N, J] += (sum_s (c_s - z) x_rs) * scale`` for rows ``r <
    BLOCK_M`` (<= 4, unrolled: one 2-D accumulator each).  ``x`` is loaded through a
    ``[BLOCK_N, J]`` pointer tensor (``zrow`` broadcasts it over the weight rows) with
    4-wide contiguity, so that it comes in the words' own register layout: no
    shared-memory layout conversion (and barrier) per slot; the duplicate addresses are
    L1 hits.  Each code is unpacked once for all rows."""
    P: tl.constexpr = 32 // BITS
    hi = w >> 16
    p0 = tl.zeros(w.shape, dtype=tl.float32)
    p1 = tl.zeros(w.shape, dtype=tl.float32)
    p2 = tl.zeros(w.shape, dtype=tl.float32)
    p3 = tl.zeros(w.shape, dtype=tl.float32)
    for s in tl.static_range(P):
        # code - zero in one FMA (the symmetric zero folds into the constant)
        c = _slot(w, hi, s, BITS, z)
        base = x_ptr + zrow[:, None] + (k0 + s * S + xoff4)[None, :]
        p0 += c * _xrow(base, 0, stride_xm, M, j_ok, J_OK)
        if BLOCK_M > 1:
            p1 += c * _xrow(base, 1, stride_xm, M, j_ok, J_OK)
        if BLOCK_M > 2:
            p2 += c * _xrow(base, 2, stride_xm, M, j_ok, J_OK)
            p3 += c * _xrow(base, 3, stride_xm, M, j_ok, J_OK)
    return a0 + p0 * sc, a1 + p1 * sc, a2 + p2 * sc, a3 + p3 * sc


@triton.jit
def _stripe_xsum(x_ptr, r: tl.constexpr, kt, t_ok, stride_xm, M, EVEN: tl.constexpr):
    """``[STRIPES]`` fp32 sums of row ``r`` of ``x`` over each stripe starting at ``kt``."""
    xo = kt[:, None] + tl.arange(0, 128)[None, :]
    if r == 0 and EVEN:
        xs = tl.load(x_ptr + xo)
    else:
        xs = tl.load(x_ptr + r * stride_xm + xo, mask=t_ok[:, None] & (r < M), other=0.0)
    return tl.sum(xs.to(tl.float32), axis=1)


@triton.jit
def _zero_step(x_ptr, s_ptr, z_ptr, rows, k0, stride_xm, stride_sn, stride_zn, M,
               c0, c1, c2, c3, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               STRIPES: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr):
    """The zero points' share of the step at ``k0`` (module doc): ``c_r [BLOCK_N] +=
    sum_t scale * (2**(BITS-1) - z) * sum(x_r over stripe t)``.  The product of a scale
    and a small integer is exact in fp32, so only the sums' roundings differ from
    subtracting ``z`` from each code."""
    kt = k0 + tl.arange(0, STRIPES) * 128
    t_ok = kt < K
    g = kt // GROUP
    s_offs = rows[:, None] * stride_sn + g[None, :]
    z_offs = rows[:, None] * stride_zn + g[None, :]
    if EVEN:  # every step is whole
        sc = tl.load(s_ptr + s_offs).to(tl.float32)
        z = tl.load(z_ptr + z_offs)
    else:
        sc = tl.load(s_ptr + s_offs, mask=t_ok[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + z_offs, mask=t_ok[None, :], other=0.0)
    zs = sc * ((1 << (BITS - 1)) - z.to(tl.float32))
    c0 += tl.sum(zs * _stripe_xsum(x_ptr, 0, kt, t_ok, stride_xm, M, EVEN)[None, :], axis=1)
    if BLOCK_M > 1:
        c1 += tl.sum(zs * _stripe_xsum(x_ptr, 1, kt, t_ok, stride_xm, M, EVEN)[None, :], axis=1)
    if BLOCK_M > 2:
        c2 += tl.sum(zs * _stripe_xsum(x_ptr, 2, kt, t_ok, stride_xm, M, EVEN)[None, :], axis=1)
        c3 += tl.sum(zs * _stripe_xsum(x_ptr, 3, kt, t_ok, stride_xm, M, EVEN)[None, :], axis=1)
    return c0, c1, c2, c3


@triton.jit
def _store_row(out_base, r: tl.constexpr, acc, corr, rn, N, M, stride_om):
    tl.store(out_base + r * stride_om + rn, (tl.sum(acc, axis=1) + corr).to(
        out_base.dtype.element_ty), mask=(rn < N) & (r < M))


@triton.jit
def _stripe_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_qn,
                        stride_sn, stride_zn, stride_om, stride_os, K: tl.constexpr,
                        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        STRIPES: tl.constexpr, K_CHUNK: tl.constexpr,
                        EVEN: tl.constexpr, USE_PDL: tl.constexpr,
                        AHEAD: tl.constexpr = False):
    """Up to ``BLOCK_M`` (1, 2 or 4) rows of ``x`` on elementwise fp32 FMAs (module
    doc); the accumulators are reduced along K once, at the end.  ``AHEAD`` (``EVEN``
    only): each step's words and scales are loaded before the previous step's arithmetic,
    so that the loads are in flight during it (the last step re-reads its own, an L1/L2
    hit); it pays for long rows (down_proj: 22.7 -> 17.4 us on an H200) and not for
    short ones, so the tuned table chooses it per shape.  ``HAS_ZERO``: the symmetric loop plus
    ``_zero_step``'s correction (module doc)."""
    P: tl.constexpr = 32 // BITS
    S: tl.constexpr = 128 // P
    J: tl.constexpr = STRIPES * S  # words per row per step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # out-of-range rows re-read row N-1
    rj = tl.arange(0, J)
    # input of slot 0 of word j, from the step's start: runs of S (4-aligned, contiguous)
    xoff4 = tl.max_contiguous(tl.multiple_of((rj // S) * 128 + rj % S, 4), 4)
    zrow = rn * 0
    k_start = pid_k * K_CHUNK
    # The first step's weights are fetched before the PDL wait (kernels/pdl.py: weights
    # are never written by a kernel).
    j_ok = (k_start + (rj // S) * 128) < K
    w = _load_words(qw_ptr, rows, k_start, rj, stride_qn, EVEN, j_ok, BITS)
    sc, z = _group_params(s_ptr, z_ptr, rows, k_start, rj, stride_sn, stride_zn, EVEN,
                          j_ok, BITS, GROUP, S, False)
    pdl_wait(USE_PDL)
    a0 = tl.zeros((BLOCK_N, J), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, J), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, J), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N, J), dtype=tl.float32)
    c0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    STEP: tl.constexpr = STRIPES * 128
    if AHEAD:
        for kt in range(0, K_CHUNK, STEP):
            kn = k_start + tl.minimum(kt + STEP, K_CHUNK - STEP)
            wn = _load_words(qw_ptr, rows, kn, rj, stride_qn, True, j_ok, BITS)
            scn, zn = _group_params(s_ptr, z_ptr, rows, kn, rj, stride_sn, stride_zn, True,
                                    j_ok, BITS, GROUP, S, False)
            a0, a1, a2, a3 = _gemv_step(x_ptr, w, sc, z, zrow, k_start + kt, xoff4, j_ok,
                                        stride_xm, M, a0, a1, a2, a3, BITS, S, BLOCK_M, True)
            if HAS_ZERO:
                c0, c1, c2, c3 = _zero_step(x_ptr, s_ptr, z_ptr, rows, k_start + kt,
                                            stride_xm, stride_sn, stride_zn, M, c0, c1, c2,
                                            c3, K, BITS, GROUP, STRIPES, BLOCK_M, True)
            w, sc, z = wn, scn, zn
    else:
        a0, a1, a2, a3 = _gemv_step(x_ptr, w, sc, z, zrow, k_start, xoff4, j_ok, stride_xm,
                                    M, a0, a1, a2, a3, BITS, S, BLOCK_M, EVEN)
        if HAS_ZERO:
            c0, c1, c2, c3 = _zero_step(x_ptr, s_ptr, z_ptr, rows, k_start, stride_xm,
                                        stride_sn, stride_zn, M, c0, c1, c2, c3, K, BITS,
                                        GROUP, STRIPES, BLOCK_M, EVEN)
        for kt in range(STEP, K_CHUNK, STEP):
            k0 = k_start + kt
            j_ok = (k0 + (rj // S) * 128) < K
            w = _load_words(qw_ptr, rows, k0, rj, stride_qn, EVEN, j_ok, BITS)
            sc, z = _group_params(s_ptr, z_ptr, rows, k0, rj, stride_sn, stride_zn, EVEN,
                                  j_ok, BITS, GROUP, S, False)
            a0, a1, a2, a3 = _gemv_step(x_ptr, w, sc, z, zrow, k0, xoff4, j_ok, stride_xm,
                                        M, a0, a1, a2, a3, BITS, S, BLOCK_M, EVEN)
            if HAS_ZERO:
                c0, c1, c2, c3 = _zero_step(x_ptr, s_ptr, z_ptr, rows, k0, stride_xm,
                                            stride_sn, stride_zn, M, c0, c1, c2, c3, K,
                                            BITS, GROUP, STRIPES, BLOCK_M, EVEN)
    # The trigger after the last load, not first (kernels/pdl.py: measured).
    pdl_trigger(USE_PDL)
    out_base = out_ptr + pid_k.to(tl.int64) * stride_os
    _store_row(out_base, 0, a0, c0, rn, N, M, stride_om)
    if BLOCK_M > 1:
        _store_row(out_base, 1, a1, c1, rn, N, M, stride_om)
    if BLOCK_M > 2:
        _store_row(out_base, 2, a2, c2, rn, N, M, stride_om)
        _store_row(out_base, 3, a3, c3, rn, N, M, stride_om)


@triton.jit
def _stripe_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_qn,
                       stride_sn, stride_zn, stride_om, stride_os, K: tl.constexpr,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       STRIPES: tl.constexpr, K_CHUNK: tl.constexpr, EVEN: tl.constexpr,
                       IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """``BLOCK_M >= 16`` rows on tensor cores: per step and slot, the dequantised
    ``[BLOCK_N, J]`` tile (in ``x.dtype``) meets ``x``'s ``[BLOCK_M, J]`` slot columns in
    one ``tl.dot`` (the sum over k is order-free)."""
    pdl_start(USE_PDL)
    P: tl.constexpr = 32 // BITS
    S: tl.constexpr = 128 // P
    J: tl.constexpr = STRIPES * S
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m  # N-major: a weight tile's row tiles run together (L2 reuse)
    pid_m = pid % num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rj = tl.arange(0, J)
    xoff = tl.max_contiguous(tl.multiple_of((rj // S) * 128 + rj % S, S), S)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * K_CHUNK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_CHUNK, STRIPES * 128):
        k0 = k_start + kt
        j_ok = (k0 + (rj // S) * 128) < K
        w = _load_words(qw_ptr, rows, k0, rj, stride_qn, EVEN, j_ok, BITS)
        sc, z = _group_params(s_ptr, z_ptr, rows, k0, rj, stride_sn, stride_zn, EVEN,
                              j_ok, BITS, GROUP, S, HAS_ZERO)
        hi = w >> 16
        for s in tl.static_range(P):
            wd = _slot(w, hi, s, BITS, z) * sc  # (code - zero) * scale, as the reference
            xs = tl.load(x_rows + (k0 + s * S + xoff)[None, :],
                         mask=m_ok[:, None] & j_ok[None, :], other=0.0)
            wt = tl.trans(wd.to(xs.dtype))
            if IEEE:  # fp32 activations, or bf16 in the interpreter (see wna16.py)
                acc = tl.dot(xs.to(tl.float32), wt.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(xs, wt, acc)
    tl.store(out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om
             + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (rn < N)[None, :])


@triton.jit
def _stripe_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, stride_qn, stride_sn,
                           stride_zn, stride_on, K: tl.constexpr, BITS: tl.constexpr,
                           GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                           BLOCK_N: tl.constexpr, STRIPES: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """``out[N, K] = (code - zero) * scale`` in ``out``'s dtype, in input order."""
    P: tl.constexpr = 32 // BITS
    S: tl.constexpr = 128 // P
    J: tl.constexpr = STRIPES * S
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * (STRIPES * 128)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rj = tl.arange(0, J)
    j_ok = (k0 + (rj // S) * 128) < K
    w = _load_words(qw_ptr, rows, k0, rj, stride_qn, False, j_ok, BITS)
    sc, z = _group_params(s_ptr, z_ptr, rows, k0, rj, stride_sn, stride_zn, False, j_ok,
                          BITS, GROUP, S, HAS_ZERO)
    # The scratch it writes may still be read by the previous layer's GEMM.
    pdl_start(USE_PDL)
    hi = w >> 16
    xoff = (rj // S) * 128 + rj % S
    ok = (rn < N)[:, None] & j_ok[None, :]
    for s in tl.static_range(P):
        wd = _slot(w, hi, s, BITS, z) * sc
        tl.store(out_ptr + rn.to(tl.int64)[:, None] * stride_on + (k0 + s * S + xoff)[None, :],
                 wd.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launch

StripeConfig = tuple[int, ...]  # block_m, block_n, stripes, warps, stages, split_k
# [, ahead] (block_m 1, 2, 4: the GEMV kernel; >= 16: the tensor-core kernel; ahead 1:
# the GEMV's register prefetch, ``_stripe_gemv_kernel``'s AHEAD, where K divides evenly)

GEMV_MAX_M = 4  # rows the GEMV kernel takes (block_m 1, 2, 4)


@functools.cache
def _tuned_file() -> dict:
    return load_tuned_table("wna16")


def tuned_threshold(name: str) -> int | None:
    """A dispatch threshold the sweep recommended (``summary[name]`` of the tuned file:
    ``dequant_min_m``, ``tinygemm_max_m``), if any."""
    value = _tuned_file().get("summary", {}).get(name)
    return None if value is None else int(value)


@functools.cache
def tuned_table() -> dict[tuple[int, int, int], StripeConfig]:
    """``PAGEDLLM_WNA16_CONFIGS`` (else the shipped table of this GPU model): a JSON file
    written by ``benchmarks/wna16_sweep.py``
    (``{"configs": [[m, n, k, [block_m, block_n, stripes, warps, stages, split(,
    ahead)]], ...]}``)
    whose entries override :func:`stripe_config` for the smallest swept ``m >= M`` at
    that ``(n, k)``; empty without either."""
    data = _tuned_file()
    if not data:
        return {}
    return {(int(m), int(n), int(k)): tuple(int(v) for v in cfg)  # type: ignore[misc]
            for m, n, k, cfg in data["configs"]}


@functools.lru_cache(maxsize=4096)  # eager (prefill) steps call it per layer
def stripe_config(m: int, n: int, k: int, device: torch.device) -> StripeConfig:
    """Launch configuration by row count: the tuned table's (:func:`tuned_table`) if it
    has the shape, else priors (not yet swept on a GPU; ``benchmarks/wna16_sweep.py``
    prints the best per shape): the GEMV reads a few KB of int4 a step per program with
    enough programs to fill the device; tiles follow the usual Triton W4A16 shapes."""
    cfg = smallest_fit(tuned_table(), m, n, k)
    if cfg is not None and (cfg[0] >= m or cfg[0] >= 16):  # a GEMV entry must hold every row
        return cfg
    if m <= GEMV_MAX_M:
        bm = 1 if m == 1 else triton.next_power_of_2(m)
        bn, stripes, warps, stages = 8, 8 if m == 1 else 4, 4, 1
    elif m <= 16:
        bm, bn, stripes, warps, stages = 16, 32, 2, 4, 3
    elif m <= 64:
        bm, bn, stripes, warps, stages = 64, 64, 1, 4, 3
    else:
        bm, bn, stripes, warps, stages = 128, 128, 1, 8, 3
    programs = -(-m // bm) * -(-n // bn)
    steps = -(-k // (stripes * STRIPE))
    split = max(1, min(target_programs(device) // programs, steps, 16))
    return bm, bn, stripes, warps, stages, split


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, bits: int, group_size: int) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected a float [M, K] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[1]
    if bits not in (4, 8) or qweight.dtype != torch.int32 or qweight.dim() != 2 \
            or qweight.shape[1] * 32 // bits != k:
        raise ValueError(f"qweight: expected int32 [N, {k}*{bits}/32], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if group_size == -1:
        group_size = k
    if not stripe_applies(bits, k, group_size, False):
        raise ValueError(f"group_size: the striped layout needs K % 128 == 0 and a group "
                         f"that is a multiple of 128 or K; got K={k}, group {group_size}")
    n = qweight.shape[0]
    if tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"scales: expected [{n}, {k // group_size}], got "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (tuple(zeros.shape) != (n, k // group_size)
                              or zeros.dtype != torch.float32):
        raise ValueError(f"zeros: expected fp32 [{n}, {k // group_size}] or None, got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    return n, k, group_size


def stripe_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The oracle on the striped layout: the canonical reference of ``from_stripes``."""
    from pagedllm.kernels.wna16 import wna16_ref

    return wna16_ref(x, from_stripes(qweight, bits), scales, zeros, None, bits, group_size)


def stripe_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, bits: int, group_size: int,
                config: StripeConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` times the striped weight -> ``[M, N]`` in ``x.dtype`` (module doc).
    ``config`` overrides :func:`stripe_config`.  CPU tensors outside the interpreter get
    :func:`stripe_ref`."""
    n, k, group_size = _check(x, qweight, scales, zeros, bits, group_size)
    if not x.is_cuda and not _INTERPRET:
        return stripe_ref(x, qweight, scales, zeros, bits, group_size)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or stripe_config(m, n, k, x.device)
    bm, bn, stripes, warps, stages, split = cfg[:6]
    k_chunk, split = split_k_chunk(k, stripes * STRIPE, split)
    ahead = len(cfg) > 6 and bool(cfg[6]) and k % k_chunk == 0  # the kernel's EVEN
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    pdl = pdl_launch_args(x.device)
    args = (x, qweight, scales, zeros if zeros is not None else scales, target, m, n,
            x.stride(0), qweight.stride(0), scales.stride(0),
            zeros.stride(0) if zeros is not None else 0, n, m * n if split > 1 else 0)
    consts = dict(K=k, BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None,
                  BLOCK_M=bm, BLOCK_N=bn, STRIPES=stripes, K_CHUNK=k_chunk,
                  EVEN=k % k_chunk == 0,
                  num_warps=warps, num_stages=stages, **pdl)
    if bm <= 8:
        if bm not in (1, 2, 4) or m > bm:
            raise ValueError(f"config: the GEMV kernel takes block_m 1, 2 or 4 >= M={m}, "
                             f"got {bm}")
        _stripe_gemv_kernel[(-(-n // bn), split)](*args, AHEAD=ahead, **consts)
    else:
        if bm & (bm - 1):
            raise ValueError(f"config: block_m={bm} must be a power of two")
        ieee = x.dtype == torch.float32 or (_INTERPRET and x.dtype == torch.bfloat16)
        _stripe_mma_kernel[(-(-m // bm) * -(-n // bn), split)](*args, IEEE=ieee, **consts)
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out


def stripe_dequantize(qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, bits: int, group_size: int,
                      out: torch.Tensor) -> torch.Tensor:
    """The striped weight -> ``out [N, K]`` (its dtype; a scratch buffer), input order."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 32 // bits
    if group_size == -1:
        group_size = k
    if tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{n}, {k}] with contiguous rows, got "
                         f"{tuple(out.shape)}")
    if not qweight.is_cuda and not _INTERPRET:
        from pagedllm.kernels.wna16 import dequantize

        return out.copy_(dequantize(from_stripes(qweight, bits), scales, zeros, None, bits,
                                    group_size, k))
    bn, stripes = 16, 2
    _stripe_dequant_kernel[(-(-n // bn), -(-k // (stripes * STRIPE)))](
        qweight, scales, zeros if zeros is not None else scales, out, n,
        qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0,
        out.stride(0), K=k, BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None,
        BLOCK_N=bn, STRIPES=stripes, num_warps=4, **pdl_launch_args(qweight.device))
    return out
