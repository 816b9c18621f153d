"""W4A16 small-``M`` kernels on the *K-major* layout of ``kernels/wna16_tc.py``: a decode
GEMV (elementwise fp32 FMAs, 1..8 rows) and a dequantise-to-``[N, K]`` kernel (for cuBLAS
at large ``M``), so that a 4-bit layer can keep this one copy of its weight (the
tensor-core GEMM reads it for ``M >= 16``) instead of a striped one besides.

Layout (``wna16_tc.to_kmajor``; ``G`` a multiple of 128, or ``K``):

```
 qweight_t  int32 [K / 8, N]   word (w, n), bits 4s..4s+3: code of input 8w + s, column n
 scales_t   [K / G, N]         activation dtype
 zeros_t    [K / G, N]         integer code units, fp32 or the scales' dtype (exact in
                               bf16/fp16; read as fp32), or None: symmetric, zero = 8

 w[n, k] = (code[n, k] - zero[g(k), n]) * scale[g(k), n],   g(k) = k // G
```

GEMV.  A program owns ``BLOCK_N`` columns and a K chunk (split-K over programs).  Per
step it loads a ``[BLOCK_K / 8, BLOCK_N]`` word tile: ``BLOCK_K / 8`` contiguous runs of
``4 * BLOCK_N`` bytes (coalesced), each word read once.  Slot ``s`` of the tile is the
``[BLOCK_K / 8, BLOCK_N]`` code tile of inputs ``k0 + 8w + s``, unpacked in place with the
fp32 magic-number trick of ``kernels/wna16_stripe.py`` (``_slot``: one LOP3 and one FMA a
code, the symmetric zero 8 folded into the FMA's constant, exact) and met by ``x[m, k0 +
8w + s]``, a ``[BLOCK_K / 8]`` vector broadcast along N (a thread loads only its own word
rows' values; the warp's duplicates are one broadcast).  Each code is unpacked once for
all ``BLOCK_M`` rows (1, 2, 4 or 8; one unrolled ``[BLOCK_K / 8, BLOCK_N]`` fp32
accumulator each).  A word lies in one group, so the step's products ``p_m = sum_s (c -
8) x_m`` (per word) are scaled once: ``acc_m += p_m * scale[g, n]``, one FMA per word and
row.  Zero points leave the unpacking alone, which is the symmetric one: ``sum_s (c - z)
x = sum_s (c - 8) x + (8 - z) sum_s x`` per word (a word lies in one group), so with
zero points a step also sums each word row's eight inputs (``q_m``, shared by the
``BLOCK_N`` columns) and adds ``(8 - z) q_m`` to ``p_m`` before the scaling: one FMA a
word and row, the zero tile loaded like the scales' (``_group``) for the step being
computed.  (A correction pass after the loop instead -- ``scale * (8 - z) * sum x``
per segment of the chunk -- re-read scales and zeros through shared memory at the end
of every program: Llama-3-8B's zero-point W4 ran TPOT 3.30 ms with it, 3.20-3.21 ms
with the per-step term, H100, 2026-12-06.  Folding ``z`` into the unpacking FMA
doubled the registers at one row, 126 against 64: ``benchmarks/triton_sass.py``.)
Where ``BLOCK_K`` divides ``G`` the step's scales are one ``[BLOCK_N]`` row; a
``BLOCK_K`` that is a multiple of ``G`` (more than 16 word rows a step at group 128)
reads each word row's own.  The accumulators are reduced along K once, at the end;
fp32 throughout, one rounding to ``x.dtype``.  Split-K partials (fp32 ``[split, M, N]``)
are added in a fixed order by ``int8_gemm.splitk_reduce``: deterministic.  With PDL the
first step's weights and scales (and, without ``ahead``, zero points) are loaded before
the wait (``kernels/pdl.py``: no kernel writes weights).  A configuration's ``ahead``
loads each step's tile before the previous step's arithmetic (a register prefetch:
Triton's pipeliner stages only loads that feed a dot).

Dequantise.  A program turns a ``[BLOCK_K / 8, BLOCK_N]`` word tile into ``out[n, k0 :
k0 + BLOCK_K]`` (``[N, K]``, rows contiguous): the tile is transposed in registers and
its slots put back in K order by ``wna16_tc._dequant_nk`` (a word's eight codes stay in
one thread, consecutive in K: 16-byte stores).  ``(code - zero) * scale`` is the exact
fp32 product (a small integer times a bf16/fp16 scale), rounded to the scales' dtype and
then to ``out``'s: bit for bit ``IntWeight.dequantize(out.dtype)`` (which computes in the
scales' dtype) and, when ``out`` has the scales' dtype (the engine's case),
``wna16.dequantize(...).to(out.dtype)``.

Contract: 4-bit; ``K % 128 == 0``; ``G`` a multiple of 128 or ``K``; ``BLOCK_K`` a power
of two dividing ``K``, and dividing ``G`` (the GEMV: or a multiple of ``G``); no
``g_idx`` (act-order weights are permuted at load by ``int_cuda.store_cuda``).  Launch
configurations depend on shapes only (no device->host sync): graph-safe.
:func:`kmajor_config` takes the tuned table of this GPU model (:func:`tuned_table`,
written by ``benchmarks/wna16_kmajor_sweep.py --table``) where it has the shape, else
priors (not yet timed on a GPU); a ``config`` argument overrides both for sweeps.
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
from pagedllm.kernels.wna16_stripe import _slot
from pagedllm.kernels.wna16_tc import _check, _dequant_nk, from_kmajor, w4a16_tc_ref

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

GEMV_MAX_M = 8  # rows the GEMV takes (block_m 1, 2, 4, 8)

# block_m, block_n, block_k, split_k, warps, stages[, ahead]: ahead 1 is the GEMV's
# register prefetch (``_advance``'s AHEAD); stages is passed to Triton, which stages only
# loads that feed a dot (none here): kept for the sweep's sake.
KmajorConfig = tuple[int, ...]


# --------------------------------------------------------------------------- kernels


@triton.jit
def _xrow(x_ptr, r: tl.constexpr, M, stride_xm):
    """Row ``r`` of ``x``, clamped to ``M - 1`` (loads need no mask; rows ``>= M`` are
    never stored)."""
    return x_ptr + tl.minimum(r, M - 1).to(tl.int64) * stride_xm


@triton.jit
def _group(s_ptr, k0, cols, rw, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``[BW, BLOCK_N]`` scales of the step's word rows.  ``BLOCK_K <= G``: one
    group, loaded through a pointer tile that repeats one row -- it gets the words'
    register layout (a ``[BLOCK_N]`` load needs a shared-memory layout conversion and two
    barriers per step on sm_90), and the compiler merges each thread's repeated addresses
    into one load.  ``BLOCK_K > G`` (several groups a step): each word row's own group."""
    if BLOCK_K > GROUP:
        bc = ((k0 + rw * 8) // GROUP * N)[:, None] + cols[None, :]
    else:
        bc = (k0 // GROUP) * N + cols[None, :] + (rw * 0)[:, None]
    return tl.load(s_ptr + bc).to(tl.float32)


@triton.jit
def _mac(xr, offs, c, p, q, HAS_ZERO: tl.constexpr):
    """One slot of one row: ``p += c * x[offs]`` (broadcast along N) and, with zero
    points, ``q += x[offs]``."""
    v = tl.load(xr + offs).to(tl.float32)
    p += c * v[:, None]
    if HAS_ZERO:
        q += v
    return p, q


@triton.jit
def _step(x0, x1, x2, x3, x4, x5, x6, x7, words, sc, zc, xo,
          a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M: tl.constexpr, HAS_ZERO: tl.constexpr):
    """``a_m [BW, BN] += (sum_s (c_s - 8) x_m[xo + s] + zc sum_s x_m[xo + s]) * sc`` for
    rows ``m < BLOCK_M``; ``zc = 8 - zero`` (``HAS_ZERO``), else no second term."""
    hi = words >> 16
    p0 = tl.zeros(words.shape, dtype=tl.float32)
    p1 = tl.zeros(words.shape, dtype=tl.float32)
    p2 = tl.zeros(words.shape, dtype=tl.float32)
    p3 = tl.zeros(words.shape, dtype=tl.float32)
    p4 = tl.zeros(words.shape, dtype=tl.float32)
    p5 = tl.zeros(words.shape, dtype=tl.float32)
    p6 = tl.zeros(words.shape, dtype=tl.float32)
    p7 = tl.zeros(words.shape, dtype=tl.float32)
    # The step's x sums per word row (HAS_ZERO): q_m [BW] = sum_s x_m[xo + s].
    q0 = tl.zeros(xo.shape, dtype=tl.float32)
    q1 = tl.zeros(xo.shape, dtype=tl.float32)
    q2 = tl.zeros(xo.shape, dtype=tl.float32)
    q3 = tl.zeros(xo.shape, dtype=tl.float32)
    q4 = tl.zeros(xo.shape, dtype=tl.float32)
    q5 = tl.zeros(xo.shape, dtype=tl.float32)
    q6 = tl.zeros(xo.shape, dtype=tl.float32)
    q7 = tl.zeros(xo.shape, dtype=tl.float32)
    for s in tl.static_range(8):
        c = _slot(words, hi, s, 4, 8.0)  # code - 8, exact
        p0, q0 = _mac(x0, xo + s, c, p0, q0, HAS_ZERO)
        if BLOCK_M > 1:
            p1, q1 = _mac(x1, xo + s, c, p1, q1, HAS_ZERO)
        if BLOCK_M > 2:
            p2, q2 = _mac(x2, xo + s, c, p2, q2, HAS_ZERO)
            p3, q3 = _mac(x3, xo + s, c, p3, q3, HAS_ZERO)
        if BLOCK_M > 4:
            p4, q4 = _mac(x4, xo + s, c, p4, q4, HAS_ZERO)
            p5, q5 = _mac(x5, xo + s, c, p5, q5, HAS_ZERO)
            p6, q6 = _mac(x6, xo + s, c, p6, q6, HAS_ZERO)
            p7, q7 = _mac(x7, xo + s, c, p7, q7, HAS_ZERO)
    if HAS_ZERO:  # sum (c - z) x = sum (c - 8) x + (8 - z) sum x: one FMA a word and row
        p0 += zc * q0[:, None]
        if BLOCK_M > 1:
            p1 += zc * q1[:, None]
        if BLOCK_M > 2:
            p2 += zc * q2[:, None]
            p3 += zc * q3[:, None]
        if BLOCK_M > 4:
            p4 += zc * q4[:, None]
            p5 += zc * q5[:, None]
            p6 += zc * q6[:, None]
            p7 += zc * q7[:, None]
    a0 += p0 * sc
    if BLOCK_M > 1:
        a1 += p1 * sc
    if BLOCK_M > 2:
        a2 += p2 * sc
        a3 += p3 * sc
    if BLOCK_M > 4:
        a4 += p4 * sc
        a5 += p5 * sc
        a6 += p6 * sc
        a7 += p7 * sc
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _load_words(qw_base, k0, rw, N):
    """The ``[BW, BLOCK_N]`` words of inputs ``k0 .. k0 + BLOCK_K`` (``qw_base``: the
    program's column pointers)."""
    return tl.load(qw_base + ((k0 // 8 + rw).to(tl.int64) * N)[:, None])


@triton.jit
def _zeros_c(z_ptr, k0, cols, rw, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
             HAS_ZERO: tl.constexpr):
    """``8 - zero``, fp32 ``[BW, BLOCK_N]`` in the scales' layout (``_group``), for the
    step's word rows; a dummy ``0.0`` without zero points (nothing loaded or carried)."""
    if HAS_ZERO:
        zc = 8.0 - _group(z_ptr, k0, cols, rw, N, GROUP, BLOCK_K)
    else:
        zc = 0.0
    return zc


@triton.jit
def _advance(x0, x1, x2, x3, x4, x5, x6, x7, qw_base, s_ptr, z_ptr, cols, rw, N, k0,
             words, sc, a0, a1, a2, a3, a4, a5, a6, a7, GROUP: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, AHEAD: tl.constexpr,
             HAS_ZERO: tl.constexpr):
    """Load step ``k0``'s words and scales (returned for the next call) and do the
    arithmetic of ``AHEAD``: the previous step (``words``, ``sc``), so that the loads
    are in flight during it, at the cost of a second word tile in registers (Triton's
    pipeliner stages only loads that feed a ``tl.dot``; ``num_stages`` does nothing
    here); else of this step (the first step is done before the loop).  The zero points
    are loaded for the step being computed, not ahead: they are needed only at its end,
    and a prefetched tile cost 32 registers at one row (96 against 64)."""
    wn = _load_words(qw_base, k0, rw, N)
    sn = _group(s_ptr, k0, cols, rw, N, GROUP, BLOCK_K)
    if AHEAD:  # the step computed now: the previous one, or this one
        kc, wc, scc = k0 - BLOCK_K, words, sc
    else:
        kc, wc, scc = k0, wn, sn
    zc = _zeros_c(z_ptr, kc, cols, rw, N, GROUP, BLOCK_K, HAS_ZERO)
    a0, a1, a2, a3, a4, a5, a6, a7 = _step(
        x0, x1, x2, x3, x4, x5, x6, x7, wc, scc, zc, kc + rw * 8,
        a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, HAS_ZERO)
    return wn, sn, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_row(out_base, r: tl.constexpr, acc, rn, N, M, stride_om):
    tl.store(out_base + r * stride_om + rn, tl.sum(acc, axis=0).to(out_base.dtype.element_ty),
             mask=(rn < N) & (r < M))


@triton.jit
def _kmajor_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_om,
                        stride_os, K: tl.constexpr, GROUP: tl.constexpr,
                        HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_CHUNK: tl.constexpr, EVEN_N: tl.constexpr,
                        AHEAD: tl.constexpr, WHILE_LOOP: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Up to ``BLOCK_M`` rows of ``x`` times ``BLOCK_N`` columns over one K chunk (module
    doc); ``HAS_ZERO``: each step adds ``(8 - zero) * sum x`` per word row."""
    BW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:  # whole tiles: contiguous, aligned columns (16-byte vector loads)
        cols = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
    else:  # the last tile re-reads column N - 1 (never stored): loads need no mask
        cols = tl.minimum(rn, N - 1)
    rw = tl.arange(0, BW)
    qw_base = qw_ptr + cols[None, :]
    k_start = pid_k * K_CHUNK
    k_stop = tl.minimum(k_start + K_CHUNK, K)  # the last chunk may be shorter
    # The first step's weights and scales before the PDL wait; its zero points too where
    # that step is computed before the loop (no register prefetch).
    words = _load_words(qw_base, k_start, rw, N)
    sc = _group(s_ptr, k_start, cols, rw, N, GROUP, BLOCK_K)
    if not AHEAD:
        zc = _zeros_c(z_ptr, k_start, cols, rw, N, GROUP, BLOCK_K, HAS_ZERO)
    pdl_wait(USE_PDL)
    x0 = _xrow(x_ptr, 0, M, stride_xm)
    x1 = _xrow(x_ptr, 1, M, stride_xm)
    x2 = _xrow(x_ptr, 2, M, stride_xm)
    x3 = _xrow(x_ptr, 3, M, stride_xm)
    x4 = _xrow(x_ptr, 4, M, stride_xm)
    x5 = _xrow(x_ptr, 5, M, stride_xm)
    x6 = _xrow(x_ptr, 6, M, stride_xm)
    x7 = _xrow(x_ptr, 7, M, stride_xm)
    a0 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a1 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a2 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a3 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a4 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a5 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a6 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    a7 = tl.zeros((BW, BLOCK_N), dtype=tl.float32)
    if not AHEAD:
        a0, a1, a2, a3, a4, a5, a6, a7 = _step(
            x0, x1, x2, x3, x4, x5, x6, x7, words, sc, zc, k_start + rw * 8,
            a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, HAS_ZERO)
    if WHILE_LOOP:
        # The interpreter cannot take program-id-derived scalars as range() bounds (numpy
        # refuses int() of their shape-(1,) arrays); on the GPU the for-loop stays.
        k0 = k_start + BLOCK_K
        while k0 < k_stop:
            words, sc, a0, a1, a2, a3, a4, a5, a6, a7 = _advance(
                x0, x1, x2, x3, x4, x5, x6, x7, qw_base, s_ptr, z_ptr, cols, rw, N, k0,
                words, sc, a0, a1, a2, a3, a4, a5, a6, a7, GROUP, BLOCK_K, BLOCK_M,
                AHEAD, HAS_ZERO)
            k0 += BLOCK_K
    else:
        for k0 in range(k_start + BLOCK_K, k_stop, BLOCK_K):
            words, sc, a0, a1, a2, a3, a4, a5, a6, a7 = _advance(
                x0, x1, x2, x3, x4, x5, x6, x7, qw_base, s_ptr, z_ptr, cols, rw, N, k0,
                words, sc, a0, a1, a2, a3, a4, a5, a6, a7, GROUP, BLOCK_K, BLOCK_M,
                AHEAD, HAS_ZERO)
    if AHEAD:  # the last step, loaded by the last iteration
        zc = _zeros_c(z_ptr, k_stop - BLOCK_K, cols, rw, N, GROUP, BLOCK_K, HAS_ZERO)
        a0, a1, a2, a3, a4, a5, a6, a7 = _step(
            x0, x1, x2, x3, x4, x5, x6, x7, words, sc, zc, k_stop - BLOCK_K + rw * 8,
            a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_M, HAS_ZERO)
    # The trigger after the last load, not first (kernels/pdl.py: measured).
    pdl_trigger(USE_PDL)
    out_base = out_ptr + pid_k.to(tl.int64) * stride_os
    _store_row(out_base, 0, a0, rn, N, M, stride_om)
    if BLOCK_M > 1:
        _store_row(out_base, 1, a1, rn, N, M, stride_om)
    if BLOCK_M > 2:
        _store_row(out_base, 2, a2, rn, N, M, stride_om)
        _store_row(out_base, 3, a3, rn, N, M, stride_om)
    if BLOCK_M > 4:
        _store_row(out_base, 4, a4, rn, N, M, stride_om)
        _store_row(out_base, 5, a5, rn, N, M, stride_om)
        _store_row(out_base, 6, a6, rn, N, M, stride_om)
        _store_row(out_base, 7, a7, rn, N, M, stride_om)


@triton.jit
def _round(v, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 ``v`` -> ``dtype``, to nearest even.  ``BY_HAND``: the interpreter, whose
    fp32 -> bf16 conversion truncates."""
    if BY_HAND and dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _kmajor_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, stride_qw, stride_s,
                           stride_z, stride_on, K: tl.constexpr, GROUP: tl.constexpr,
                           HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """``out[n, k] = (code - zero) * scale`` for a ``[BLOCK_N, BLOCK_K]`` tile (module
    doc).  The row strides ``stride_qw`` / ``stride_s`` / ``stride_z`` let the weight be a
    column slice ``[:, n0:n1]`` of the layer's."""
    BW: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    cols = tl.minimum(rn, N - 1)
    rw = tl.arange(0, BW)
    words = tl.load(qw_ptr + ((k0 // 8 + rw).to(tl.int64) * stride_qw)[:, None]
                    + cols[None, :])
    g = k0 // GROUP
    sc = tl.load(s_ptr + g * stride_s + cols)
    if HAS_ZERO:
        z = tl.load(z_ptr + g * stride_z + cols).to(tl.float32)[:, None]
    else:
        z = 8.0
    # The buffer it writes may still be read by the previous kernel (a shared scratch).
    pdl_start(USE_PDL)
    cz = _dequant_nk(tl.trans(words), sc, z, tl.float32, True)  # [BN, BK] code - zero
    w = _round(cz * sc.to(tl.float32)[:, None], s_ptr.dtype.element_ty, ROUND_BY_HAND)
    if out_ptr.dtype.element_ty != s_ptr.dtype.element_ty:
        w = _round(w.to(tl.float32), out_ptr.dtype.element_ty, ROUND_BY_HAND)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * stride_on + rk[None, :], w,
             mask=(rn < N)[:, None])


# --------------------------------------------------------------------------- launch


@functools.cache
def tuned_table() -> dict[tuple[int, int, int], KmajorConfig]:
    """``PAGEDLLM_WNA16_KMAJOR_CONFIGS`` (else the shipped table of this GPU model): a
    JSON file written by ``benchmarks/wna16_kmajor_sweep.py --table``
    (``{"configs": [[m, n, k, [block_m, block_n, block_k, split_k, warps, stages,
    ahead]], ...]}``); empty without either.  An entry that :func:`kmajor_gemv` would
    reject is a ``ValueError`` naming the variable, at the first launch."""
    data = load_tuned_table("wna16_kmajor")
    table: dict[tuple[int, int, int], KmajorConfig] = {}
    for m, n, k, cfg in data.get("configs", []):
        entry = tuple(int(v) for v in cfg)
        try:
            _check_config(entry, int(m), int(k), 128)
        except ValueError as e:
            raise ValueError(f"PAGEDLLM_WNA16_KMAJOR_CONFIGS: the entry for M={m}, "
                             f"N={n}, K={k}: {e}") from None
        table[(int(m), int(n), int(k))] = entry
    return table


def has_table() -> bool:
    """Whether this GPU has a tuned GEMV table (``PAGEDLLM_WNA16_KMAJOR_CONFIGS`` or the
    shipped one).  ``int_cuda.store_cuda`` stores symmetric 4-bit layers K-major only
    then: with the priors the striped GEMV is the faster one for them."""
    return bool(tuned_table())


@functools.lru_cache(maxsize=4096)
def kmajor_config(m: int, n: int, k: int, device: torch.device) -> KmajorConfig:
    """The tuned table's entry for the smallest swept row count ``>= m`` at ``(n, k)``
    (:func:`tuned_table`; its ``block_m`` holds every row), else the priors below.

    Priors for ``m <= 8`` rows, not yet timed on a GPU, chosen from sm_90 compiles
    (ptxas): no spills, and the most word bytes in flight per SM at the occupancy the
    registers allow -- 8 words a thread (4 at 8 rows) with the register prefetch (two
    tiles in flight a program): 128 registers at 1-2 rows (4 programs of 4 warps an
    SM), 96 at 4 rows, 168 at 8 rows (2-warp programs).  Split-K until the grid has
    the device's target program count (:func:`auto_split`).  ``block_k`` <= 128 divides
    every K and group the layout takes (module doc)."""
    if m > GEMV_MAX_M:
        raise ValueError(f"kmajor_config: the GEMV takes at most {GEMV_MAX_M} rows, "
                         f"got {m}")
    tuned = smallest_fit(tuned_table(), m, n, k)
    if tuned is not None and tuned[0] >= m:
        return tuned
    bm = 1 if m <= 1 else triton.next_power_of_2(m)
    if bm <= 2:
        bn, bk, warps = 128, 64, 4
    elif bm == 4:
        bn, bk, warps = 128, 32, 4
    else:
        bn, bk, warps = 64, 32, 2
    return bm, bn, bk, auto_split(n, k, bn, bk, device), warps, 1, 1


def auto_split(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Split-K that brings ``cdiv(N, block_n)`` programs up to the device's target
    (``int8_gemm.target_programs``), at most 16 and whole steps; 1 where they reach it."""
    programs = -(-n // block_n)
    target = target_programs(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), k // block_k, 16))


def _blocks_ok(bn: int, bk: int, k: int, group_size: int, several_groups: bool) -> bool:
    """Powers of two; ``block_k`` divides K and divides the group, or (``several_groups``:
    the GEMV) is a multiple of it."""
    group_fits = group_size % bk == 0 or (several_groups and bk % group_size == 0)
    return not (bn & (bn - 1) or bk & (bk - 1) or bk < 8 or k % bk) and group_fits


def _check_config(cfg: KmajorConfig, m: int, k: int, group_size: int) -> None:
    if len(cfg) not in (6, 7):
        raise ValueError(f"config: expected (block_m, block_n, block_k, split_k, warps, "
                         f"stages[, ahead]), got {cfg}")
    bm, bn, bk, split = cfg[:4]
    if bm not in (1, 2, 4, 8) or m > bm:
        raise ValueError(f"config: the GEMV takes block_m 1, 2, 4 or 8 >= M={m}, got {bm}")
    if not _blocks_ok(bn, bk, k, group_size, True):
        raise ValueError(f"config: block_n={bn} and block_k={bk} must be powers of two, "
                         f"block_k >= 8 dividing K={k} and dividing the group "
                         f"{group_size} or a multiple of it")
    if split < 1:
        raise ValueError(f"config: split_k={split} must be >= 1")


def kmajor_gemv(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                zeros_t: torch.Tensor | None, group_size: int,
                config: KmajorConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` (``M <= 8``) times the K-major 4-bit weight -> ``[M, N]`` in
    ``x.dtype`` (module doc).  ``config`` (``(block_m, block_n, block_k, split_k, warps,
    stages[, ahead])``) overrides :func:`kmajor_config`.  CPU tensors outside the interpreter get
    ``wna16_tc.w4a16_tc_ref``."""
    n, k, group_size = _check(x, qweight_t, scales_t, zeros_t, group_size)
    if not qweight_t.is_contiguous():
        raise ValueError("qweight_t: expected a contiguous [K/8, N] tensor")
    m = x.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"x: the GEMV takes at most {GEMV_MAX_M} rows, got {m}")
    if not x.is_cuda and not _INTERPRET:
        return w4a16_tc_ref(x, qweight_t, scales_t, zeros_t, group_size)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or kmajor_config(m, n, k, x.device)
    _check_config(cfg, m, k, group_size)
    bm, bn, bk, split, warps, stages = cfg[:6]
    k_chunk, split = split_k_chunk(k, bk, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    _kmajor_gemv_kernel[(triton.cdiv(n, bn), split)](
        x, qweight_t, scales_t, zeros_t if zeros_t is not None else scales_t, target, m, n,
        x.stride(0), n, m * n if split > 1 else 0, K=k, GROUP=group_size,
        HAS_ZERO=zeros_t is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_CHUNK=k_chunk,
        EVEN_N=n % bn == 0, AHEAD=len(cfg) > 6 and bool(cfg[6]), WHILE_LOOP=_INTERPRET,
        num_warps=warps, num_stages=stages,
        **pdl_launch_args(x.device))
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out


def kmajor_dequantize(qweight_t: torch.Tensor, scales_t: torch.Tensor,
                      zeros_t: torch.Tensor | None, group_size: int, out: torch.Tensor,
                      config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The K-major weight -> ``out [N, K]`` (its dtype, rows contiguous; a scratch
    buffer), input order, rounded as the module doc says.  The weight tensors may be
    column slices ``[:, n0:n1]`` of a layer's (contiguous columns, any row stride).
    ``config``: ``(block_n, block_k, warps)``.  CPU tensors outside the interpreter get
    the torch reference."""
    k = qweight_t.shape[0] * 8
    probe = torch.empty(0, k, dtype=out.dtype, device=out.device)  # _check's x: K, dtype
    # _check's shapes and dtypes on dense stand-ins (it wants contiguous tensors); the
    # strides are checked here
    dense = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
             for t in (qweight_t, scales_t, zeros_t)]
    n, k, group_size = _check(probe, dense[0], dense[1], dense[2], group_size)
    for name, t in (("qweight_t", qweight_t), ("scales_t", scales_t), ("zeros_t", zeros_t)):
        if t is not None and t.stride(1) != 1 and n > 1:
            raise ValueError(f"{name}: expected contiguous columns (a [:, n0:n1] slice at "
                             f"most), got strides {t.stride()}")
    if tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{n}, {k}] with contiguous rows, got "
                         f"{tuple(out.shape)}")
    if not qweight_t.is_cuda and not _INTERPRET:
        from pagedllm.kernels.wna16 import dequantize

        w = dequantize(from_kmajor(qweight_t), scales_t.t(),
                       None if zeros_t is None else zeros_t.t(), None, 4, group_size, k)
        return out.copy_(w.to(scales_t.dtype))  # exact fp32 product, rounded as the kernel
    if n == 0:
        return out
    bn, bk, warps = config or (64, 128, 4)
    if not _blocks_ok(bn, bk, k, group_size, False):
        raise ValueError(f"config: block_n={bn} and block_k={bk} must be powers of two, "
                         f"block_k >= 8 dividing K={k} and the group {group_size}")
    _kmajor_dequant_kernel[(triton.cdiv(n, bn), k // bk)](
        qweight_t, scales_t, zeros_t if zeros_t is not None else scales_t, out, n,
        qweight_t.stride(0), scales_t.stride(0),
        zeros_t.stride(0) if zeros_t is not None else 0, out.stride(0), K=k,
        GROUP=group_size, HAS_ZERO=zeros_t is not None, BLOCK_N=bn, BLOCK_K=bk,
        ROUND_BY_HAND=_INTERPRET, num_warps=warps,
        **pdl_launch_args(qweight_t.device))
    return out
