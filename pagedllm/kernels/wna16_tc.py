"""W4A16 tensor-core GEMM for ``M >= 16`` rows (prefill chunks, wide decode batches) on a
K-major packed layout, designed for Hopper: wide coalesced weight loads, register
dequantisation with shifts and masks, ``tl.dot`` (wgmma) with fp32 accumulation,
software pipelining, a GROUP_M swizzle and an optional split-K.

Layout (made once at load from the canonical one, ``layers/quantization/int_layout.py``):

```
 qweight  int32 [K / 8, N]   word (w, n), bits 4s..4s+3: code of input 8w + s, column n
 scales   [K / G, N]         activation dtype: scale[g, n]
 zeros    [K / G, N]         in code units, fp32 or the scales' dtype (integers: exact in
                             bf16/fp16; read as fp32), or None: symmetric, zero = 8

 w[n, k] = (code[n, k] - zero[g(k), n]) * scale[g(k), n],   g(k) = k // G
```

A program's ``[BLOCK_K / 8, BLOCK_N]`` word tile is ``BLOCK_K / 8`` contiguous runs of
``4 * BLOCK_N`` bytes (fully coalesced, 16-byte vectors for the pipeliner's async
copies), each word read once.  It is transposed in registers (a layout relabel) to
``[BLOCK_N, BLOCK_K / 8]``; the eight slots are unpacked with the fp32 magic-number trick
of ``kernels/wna16_stripe.py`` (``(h & mask) | 0x4B000000`` read as fp32 is ``2**23 +
code * 2**o``: one LOP3 and one FMA per code, no int->float conversion) and put back in
K order by a tree of ``tl.interleave`` (a join of in-thread values: no data movement), so
each thread's codes of one word stay in that thread, consecutive in K.

Where it applies (:func:`packed_unpack_applies`: bf16 activations and scales, integer
zero points in bf16 or none, ``BLOCK_K >= 128``, the scale before the dot, sm_90) the
unpack is packed-bf16 PTX instead (``_UNPACK``): two codes per LOP3, one packed subtract
and one packed multiply per pair, the same bits as the fp32 unpack (the reference's
rounding of ``(code - zero) * scale``).  Its main loop is about a third shorter
(``tests/kernels/test_wna16_tc.py``, sm_90 SASS); on an H100 (2026-12-07, the same
configurations A/B, best per projection) a 256-row step of 32 Llama-3-8B layers went from
11.0 to 9.6 ms symmetric and 13.2 to 11.3 ms with zero points.  With 64-input K tiles
some configurations gave wrong, run-to-run different results on an H100 (zero points at
``BLOCK_N = 256``; symmetric outputs unlike the fp32 unpack's), so those tiles keep the
fp32 unpack and the priors use 128-input tiles.

Two ways to meet the activations (``SWAP``, compile-time):

* ``SWAP=False``: ``acc[BM, BN] += x[BM, BK] @ w^T[BK, BN]``: the weight tile is wgmma's
  B operand, which must sit in shared memory; Triton stores it there each step and, since
  that one buffer is rewritten next step, waits for the wgmma to finish (PTX
  ``wgmma.wait_group 0`` in the loop): dequantisation and MMA do not overlap.
* ``SWAP=True``: ``acc^T[BN, BM] += w[BN, BK] @ x^T[BK, BM]``: the weight tile is the A
  operand, which wgmma reads from registers, so the step's wgmmas stay in flight
  (``wait_group BK/16 - 1``) while the next tile is loaded and dequantised; and the rows
  are wgmma's N dimension (8..256), so 16 rows are not padded to 64.  The default.

Scales (``SCALE_AFTER``, compile-time; ``G`` a multiple of ``BLOCK_K``, so a K tile lies
in one group and its scale is one ``[BLOCK_N]`` row):

* ``False``: ``w = (code - zero) * scale`` rounded to ``x.dtype`` -- bit for bit the
  reference weight (``IntWeight.dequantize``), then the dot;
* ``True``: the dot over the tile of the exact integers ``code - zero`` (exact in bf16),
  times ``scale[g, :]`` per column in fp32 after it: ``BM * BN`` multiplies per step
  instead of ``BK * BN``.  Differs from the reference only in where the scale's product
  is rounded (at most one bf16 ulp of ``w`` per term, relative 2**-9).

Contract: 4-bit codes; ``K % BLOCK_K == 0`` and ``G % BLOCK_K == 0`` (``G = K``:
channel-wise); no ``g_idx`` (act-order weights are permuted at load by
``int_cuda.store_cuda``); fp32 accumulation, one rounding to ``x.dtype``.  Split-K
partials (fp32 ``[split, M, N]``) are added in a fixed order by one reduce kernel:
deterministic, graph-safe (the split depends on shapes only).  Launch configurations come
from :mod:`pagedllm.kernels.wna16_tc_config` (a tuned table, else priors).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.int8_gemm import splitk_reduce
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start, sm90_or_newer
from pagedllm.kernels.wna16_stripe import _slot
from pagedllm.kernels.wna16_tc_config import TcConfig, tc_config

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- layout


def tc_applies(bits: int, k: int, group_size: int, has_g_idx: bool) -> bool:
    """Whether a weight can take this kernel: 4-bit, no act-order left, ``K % 128 == 0``
    and a group that is a multiple of 128 (or ``K``)."""
    return (bits == 4 and not has_g_idx and k % 128 == 0
            and (group_size == k or group_size % 128 == 0))


def to_kmajor(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical 4-bit ``int32 [N, K / 8]`` -> this kernel's ``int32 [K / 8, N]`` (the
    same words: each already holds 8 consecutive inputs of one column)."""
    return qweight.t().contiguous()


def from_kmajor(qweight_t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_kmajor`."""
    return qweight_t.t().contiguous()


# --------------------------------------------------------------------------- kernel


@triton.jit
def _dequant_nk(words_nk, sc, z, dtype: tl.constexpr, SCALE_AFTER: tl.constexpr):
    """Words ``[BN, BK / 8]`` -> ``[BN, BK]`` in ``dtype``, K in input order:
    ``code - z`` (``SCALE_AFTER``) or ``(code - z) * sc`` rounded as the reference."""
    hi = words_nk >> 16
    c0 = _slot(words_nk, hi, 0, 4, z)
    c1 = _slot(words_nk, hi, 1, 4, z)
    c2 = _slot(words_nk, hi, 2, 4, z)
    c3 = _slot(words_nk, hi, 3, 4, z)
    c4 = _slot(words_nk, hi, 4, 4, z)
    c5 = _slot(words_nk, hi, 5, 4, z)
    c6 = _slot(words_nk, hi, 6, 4, z)
    c7 = _slot(words_nk, hi, 7, 4, z)
    if not SCALE_AFTER:
        # the reference's product, (code - zero) * scale rounded to the scale's dtype:
        # the fp32 product of a small integer and a bf16/fp16 scale is exact
        c0 = (c0 * sc.to(tl.float32)).to(sc.dtype)
        c1 = (c1 * sc.to(tl.float32)).to(sc.dtype)
        c2 = (c2 * sc.to(tl.float32)).to(sc.dtype)
        c3 = (c3 * sc.to(tl.float32)).to(sc.dtype)
        c4 = (c4 * sc.to(tl.float32)).to(sc.dtype)
        c5 = (c5 * sc.to(tl.float32)).to(sc.dtype)
        c6 = (c6 * sc.to(tl.float32)).to(sc.dtype)
        c7 = (c7 * sc.to(tl.float32)).to(sc.dtype)
    c0 = c0.to(dtype)
    c1 = c1.to(dtype)
    c2 = c2.to(dtype)
    c3 = c3.to(dtype)
    c4 = c4.to(dtype)
    c5 = c5.to(dtype)
    c6 = c6.to(dtype)
    c7 = c7.to(dtype)
    # slot s of word j is input 8j + s: interleave(a, b) puts a at 2i and b at 2i + 1
    even = tl.interleave(tl.interleave(c0, c4), tl.interleave(c2, c6))
    odd = tl.interleave(tl.interleave(c1, c5), tl.interleave(c3, c7))
    return tl.interleave(even, odd)


# Packed-half unpack (PTX, sm_90): nibbles s and s + 4 of a word sit 16 bits apart, so one
# LOP3 ``(w >> 4s) & 0x000F000F | 0x43004300`` makes two bf16 ``128 + code`` (the code lands
# in the mantissa: exact), one packed subtract takes ``128 + zero`` off (exact: small
# integers) and one packed multiply applies the scale, rounded once as the reference
# rounds ``(code - zero) * scale``.  Operands: $8 the word, $9 the scale, $10 ``128 +
# zero`` (bf16); outputs $0..$7 the slots 0..7.
_UNPACK = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, w, s, b;
mov.b32 s, {$9, $9};
mov.b32 b, {$10, $10};
lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 4;
lop3.b32 t1, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 8;
lop3.b32 t2, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 12;
lop3.b32 t3, w, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 t0, t0, b;
sub.rn.bf16x2 t1, t1, b;
sub.rn.bf16x2 t2, t2, b;
sub.rn.bf16x2 t3, t3, b;
mul.rn.bf16x2 t0, t0, s;
mul.rn.bf16x2 t1, t1, s;
mul.rn.bf16x2 t2, t2, s;
mul.rn.bf16x2 t3, t3, s;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}""")


@triton.jit
def _dequant_nk_packed(words_nk, sc, z):
    """:func:`_dequant_nk` (scaled) with packed-bf16 arithmetic: ``sc [BN, 1]`` bf16,
    ``z`` fp32 integer zero points (or 8.0)."""
    zb = (z + 128.0).to(tl.bfloat16)  # 0x4300 = 128.0
    c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
        _UNPACK, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words_nk, sc, zb],
        dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
    even = tl.interleave(tl.interleave(c0, c4), tl.interleave(c2, c6))
    odd = tl.interleave(tl.interleave(c1, c5), tl.interleave(c3, c7))
    return tl.interleave(even, odd)


@triton.jit
def _w4a16_tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_om,
                     stride_os, K: tl.constexpr, GROUP: tl.constexpr,
                     HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_CHUNK: tl.constexpr,
                     SWAP: tl.constexpr, SCALE_AFTER: tl.constexpr, IEEE: tl.constexpr,
                     EVEN_N: tl.constexpr, USE_PDL: tl.constexpr, PACKED: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over ``K_CHUNK`` inputs (module doc)."""
    # Nothing before the first loads of x: start dependents, wait for the predecessor.
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M swizzle: GROUP_M row tiles sweep the columns together (x and w stay in L2)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:  # whole tiles: contiguous, aligned columns (16-byte vector loads)
        cols = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
    else:  # the last tile re-reads column N - 1 (never stored): loads need no mask
        cols = tl.minimum(rn, N - 1)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    k_start = pid_k * K_CHUNK
    x_rows = x_ptr + rm.to(tl.int64) * stride_xm
    qw_base = qw_ptr + cols[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The group parameters are loaded one step ahead by hand (the pipeliner stages only
    # the loads that feed the dot): a step never waits on a global round trip for them.
    sc_next = tl.load(s_ptr + (k_start // GROUP) * N + cols)
    if HAS_ZERO:
        z_next = tl.load(z_ptr + (k_start // GROUP) * N + cols).to(tl.float32)
    for kt in range(0, K_CHUNK, BLOCK_K):
        k0 = k_start + kt
        words = tl.load(qw_base + ((k0 // 8 + rw).to(tl.int64) * N)[:, None])
        sc = sc_next
        # the next step's group (this one's again past the chunk: a harmless L1 hit)
        g_next = (k0 + BLOCK_K * (kt + BLOCK_K < K_CHUNK)) // GROUP
        sc_next = tl.load(s_ptr + g_next * N + cols)
        if HAS_ZERO:
            z = z_next[:, None]
            z_next = tl.load(z_ptr + g_next * N + cols).to(tl.float32)
        else:
            z = 8.0
        if PACKED:  # packed-half unpack (scaled: the launcher never pairs it with SCALE_AFTER)
            if not HAS_ZERO:
                z = tl.full([BLOCK_N, 1], 8.0, tl.float32)  # the asm takes a tensor
            w_nk = _dequant_nk_packed(tl.trans(words), sc[:, None], z)
        elif SCALE_AFTER:
            w_nk = _dequant_nk(tl.trans(words), sc, z, x_ptr.dtype.element_ty, True)
        else:
            w_nk = _dequant_nk(tl.trans(words), sc[:, None], z, x_ptr.dtype.element_ty,
                               False)
        if SWAP:
            xt = tl.load(x_rows[None, :] + (k0 + rk)[:, None], mask=m_ok[None, :],
                         other=0.0)
            if IEEE:  # fp32 activations, or bf16 in the interpreter (no bf16 numpy dot)
                part = tl.dot(w_nk.to(tl.float32), xt.to(tl.float32),
                              input_precision="ieee")
            else:
                part = tl.dot(w_nk, xt)
            if SCALE_AFTER:
                acc += part * sc.to(tl.float32)[:, None]
            else:
                acc += part
        else:
            xs = tl.load(x_rows[:, None] + (k0 + rk)[None, :], mask=m_ok[:, None],
                         other=0.0)
            w_kn = tl.trans(w_nk)
            if SCALE_AFTER:
                if IEEE:
                    part = tl.dot(xs.to(tl.float32), w_kn.to(tl.float32),
                                  input_precision="ieee")
                else:
                    part = tl.dot(xs, w_kn)
                acc += part * sc.to(tl.float32)[None, :]
            else:
                if IEEE:
                    acc = tl.dot(xs.to(tl.float32), w_kn.to(tl.float32), acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(xs, w_kn, acc)
    if SWAP:
        res = tl.trans(acc)
    else:
        res = acc
    out = out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om \
        + rn[None, :]
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])


# --------------------------------------------------------------------------- launch


def even_split(k: int, block_k: int, split: int) -> tuple[int, int]:
    """``(k_chunk, split)`` with ``split * k_chunk == k`` exactly: the largest split
    ``<= split`` that divides the ``k / block_k`` steps.  The kernel's K loop has no
    bound check (``K_CHUNK`` is a constexpr), so a last chunk shorter than the others
    (``int8_gemm.split_k_chunk``'s rounding) would read ``x``, the words and the scales
    past K -- garbage, nan, or an illegal address on the GPU (issue: H200 run 1)."""
    steps = k // block_k
    split = max(1, min(split, steps))
    while steps % split:
        split -= 1
    return k // split, split


def packed_unpack_applies(x: torch.Tensor, scales_t: torch.Tensor,
                          zeros_t: torch.Tensor | None, block_k: int,
                          scale_after: bool) -> bool:
    """Whether a launch unpacks with the packed-half PTX (module doc): CUDA on sm_90+,
    bf16 activations and scales (fp16 would take ``f16x2`` ops and ``0x6400``, not yet
    checked on a GPU), zero points none or bf16 (integers: ``int_cuda`` keeps fp32 for
    any other), ``block_k >= 128`` and the scale applied before the dot."""
    return (not _INTERPRET and not scale_after and block_k >= 128
            and x.dtype == torch.bfloat16 and scales_t.dtype == x.dtype
            and (zeros_t is None or zeros_t.dtype == x.dtype) and sm90_or_newer(x.device))


def _check(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
           zeros_t: torch.Tensor | None, group_size: int) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected a float [M, K] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[1]
    if qweight_t.dtype != torch.int32 or qweight_t.dim() != 2 or qweight_t.shape[0] * 8 != k:
        raise ValueError(f"qweight_t: expected int32 [{k}/8, N], got {qweight_t.dtype} "
                         f"{tuple(qweight_t.shape)}")
    if group_size == -1:
        group_size = k
    if not tc_applies(4, k, group_size, False):
        raise ValueError(f"group_size: the W4A16 tensor-core kernel needs K % 128 == 0 and "
                         f"a group that is a multiple of 128 or K; got K={k}, group "
                         f"{group_size}")
    n = qweight_t.shape[1]
    if tuple(scales_t.shape) != (k // group_size, n) or not scales_t.is_contiguous():
        raise ValueError(f"scales_t: expected contiguous [{k // group_size}, {n}], got "
                         f"{tuple(scales_t.shape)}")
    if zeros_t is not None and (tuple(zeros_t.shape) != (k // group_size, n)
                                or zeros_t.dtype not in (torch.float32, scales_t.dtype)
                                or not zeros_t.is_contiguous()):
        raise ValueError(f"zeros_t: expected contiguous fp32 or {scales_t.dtype} "
                         f"[{k // group_size}, {n}] or None, got {zeros_t.dtype} "
                         f"{tuple(zeros_t.shape)}")
    return n, k, group_size


def w4a16_tc_ref(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                 zeros_t: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The oracle: the canonical reference (``kernels/wna16.wna16_ref``) of the same
    weight, in ``x.dtype``."""
    from pagedllm.kernels.wna16 import wna16_ref

    return wna16_ref(x, from_kmajor(qweight_t), scales_t.t().contiguous(),
                     None if zeros_t is None else zeros_t.t().contiguous(), None, 4,
                     group_size)


def w4a16_tc_gemm(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                  zeros_t: torch.Tensor | None, group_size: int,
                  config: TcConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` times the K-major 4-bit weight -> ``[M, N]`` in ``x.dtype`` (module
    doc).  ``config`` (``(block_m, block_n, block_k, group_m, warps, stages, split_k, swap,
    scale_after)``) overrides :func:`wna16_tc_config.tc_config`.  CPU tensors outside
    the interpreter get :func:`w4a16_tc_ref`."""
    n, k, group_size = _check(x, qweight_t, scales_t, zeros_t, group_size)
    if not x.is_cuda and not _INTERPRET:
        return w4a16_tc_ref(x, qweight_t, scales_t, zeros_t, group_size)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        config = tc_config(m, n, k, x.device)
    bm, bn, bk, gm, warps, stages, split, swap, after = config
    if group_size % bk or k % bk:
        raise ValueError(f"config: block_k={bk} must divide K={k} and the group "
                         f"{group_size}")
    k_chunk, split = even_split(k, bk, split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    ieee = x.dtype == torch.float32 or (_INTERPRET and x.dtype != torch.float32)
    packed = packed_unpack_applies(x, scales_t, zeros_t, bk, bool(after))  # implies not ieee
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _w4a16_tc_kernel[grid](
        x, qweight_t, scales_t, zeros_t if zeros_t is not None else scales_t, target, m, n,
        x.stride(0), n, m * n if split > 1 else 0, K=k, GROUP=group_size,
        HAS_ZERO=zeros_t is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
        K_CHUNK=k_chunk, SWAP=bool(swap), SCALE_AFTER=bool(after), IEEE=ieee,
        EVEN_N=n % bn == 0, PACKED=packed,
        num_warps=warps, num_stages=stages, **pdl_launch_args(x.device))
    if split > 1:
        splitk_reduce(target, out)  # fixed order: deterministic
    return out
