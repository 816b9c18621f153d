"""Paged attention for a flattened mixed batch in one launch (plus a split-KV variant).

What it computes (contract of ``pagedllm.attention.metadata``): for request ``r`` with
``q_len = query_start_loc[r+1] - query_start_loc[r]`` new tokens and ``seq_len =
seq_lens[r]`` tokens of context (new ones included), new token ``i`` sits at absolute
position ``seq_len - q_len + i`` and attends to cached positions ``0 .. that position``,
read through ``block_tables[r]``.  Prefill chunks (with or without cached context) and
single-token decodes may appear in any order.

Grid design (after vLLM's ``unified_attention`` Triton kernel)::

    axis 0: query tiles.  Each request's tokens are cut into tiles of BLOCK_Q tokens; a
            program finds its request by binary search over ``query_start_loc`` using the
            "tile start" ``query_start_loc[r] // BLOCK_Q + r``.  The grid size is the
            upper bound ``num_tokens // BLOCK_Q + num_reqs`` -- host ints only, so the
            launch is CUDA-graph safe; surplus programs exit at once.  A decode-only
            launch (``max_query_len <= 1``) skips the search: program r is request r,
            whose one token is row r.
    axis 1: KV heads.  A program handles BLOCK_Q tokens x all GQA query heads of its KV
            head (BLOCK_M = BLOCK_Q * GQA rows, padded to a power of two), so each K/V
            tile is loaded once for the whole group and both products run on tensor
            cores (tl.dot needs M >= 16, which is why decodes pack GQA heads as rows).
    axis 2: KV splits (only on the split path).  Split ``s`` of ``S`` handles a
            contiguous run of the KV tiles this query tile needs; it writes an
            unnormalised partial output with its running max and sum, and
            ``_reduce_splits_kernel`` merges the S partials (flash-decoding).

Inside a program: online softmax in the log2 domain (scores * scale * log2(e), exp2),
fp32 accumulation, P cast to the cache dtype for the P@V product (as FlashAttention
does).  KV positions are gathered per token through the block table, so the KV tile
width TILE_N is independent of the cache's block size.  Every offset that involves a
block id or a token index is int64 (``block_id * block_stride`` passes 2**31 with ~65k
blocks of 16 x 8 x 128 elements, let alone more).

An fp8 cache (``attention/kv_cache_dtype.py``) is dequantised in registers: K and V tiles
are upcast to the query's dtype as they are loaded, ``k_scale`` is folded into the
softmax scale on the host and ``v_scale`` multiplies the accumulator once before it is
stored (the split partials are linear in V, so the merge needs no scale).

(Multiplying in fp8 instead, FlashAttention-3 style, Q and P rounded to e4m3, was faster
on the H200 for large decode batches, slower for prompt chunks, with 25x the mean error;
removed, git has it.)

The split decision is made on the host from ints that a CUDA graph keeps fixed (number of
requests, max query length, heads, SM count), never from device tensors; the kernel
itself adapts the split ranges to each request's actual ``seq_len``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32


@triton.jit
def _mma(a, b, F32_DOT: tl.constexpr):
    # fp32 inputs get exact (IEEE) products instead of TF32.  The interpreter also takes
    # this path for 16-bit inputs because its bf16 tl.dot is broken (garbage results in
    # triton 3.6); upcasting bf16/fp16 is exact, so the numerics match the GPU's MMA.
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _find_request(qsl_ptr, tile_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= tile_idx (binary search)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid)
        if start // BLOCK_Q + mid <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_blocks(t, kv_end, bt_row, offs_n, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """KV positions of tile ``t``, which of them exist, and their cache block ids."""
    kv_pos = t * TILE_N + offs_n
    kv_ok = kv_pos < kv_end
    block_id = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    return kv_pos, kv_ok, block_id


@triton.jit
def _attn_tile(
    t, q, q_pos, q_lim, m_i, l_i, acc, kv_end, bt_row, kv_head_off, k_cache_ptr, v_cache_ptr,
    stride_cb, stride_cs, scale_log2, dims, dim_ok, offs_n,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, F32_DOT: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """One KV tile of the online softmax: returns the updated (m, l, acc)."""
    kv_pos, kv_ok, block_id = _tile_blocks(t, kv_end, bt_row, offs_n, BLOCK_SIZE, TILE_N)
    return _attn_tile_blocks(q, q_pos, q_lim, m_i, l_i, acc, kv_pos, kv_ok, block_id,
                             kv_head_off, k_cache_ptr, v_cache_ptr, stride_cb, stride_cs,
                             scale_log2, dims, dim_ok, BLOCK_SIZE, F32_DOT, WINDOW, SOFTCAP)


@triton.jit
def _attn_tile_blocks(
    q, q_pos, q_lim, m_i, l_i, acc, kv_pos, kv_ok, block_id, kv_head_off, k_cache_ptr,
    v_cache_ptr, stride_cb, stride_cs, scale_log2, dims, dim_ok,
    BLOCK_SIZE: tl.constexpr, F32_DOT: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """``_attn_tile`` with the tile's block ids already loaded.  ``WINDOW`` > 0: keys
    more than WINDOW - 1 positions behind the query are masked; ``SOFTCAP`` > 0: scores
    (scaled) become ``SOFTCAP * tanh(score / SOFTCAP)`` (attention/kinds.py).  Keys
    after ``q_lim`` are masked (``q_pos`` itself unless ``query_limits`` are given)."""
    kv_off = block_id * stride_cb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
    kv_off += kv_head_off
    # .to(q.dtype): a no-op for a cache in the model dtype, the dequantisation of fp8.
    k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                mask=dim_ok[:, None] & kv_ok[None, :], other=0.0).to(q.dtype)  # [DIM, TILE_N]
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                mask=kv_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)  # [TILE_N, DIM]
    s = _mma(q, k, F32_DOT) * scale_log2
    if SOFTCAP > 0:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 for large |x|.
        x = s * (1.0 / (1.4426950408889634 * SOFTCAP))
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * 1.4426950408889634)
    visible = (kv_pos[None, :] <= q_lim[:, None]) & kv_ok[None, :]
    if WINDOW > 0:
        visible = visible & (kv_pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, F32_DOT)
    return m_new, l_i, acc


@triton.jit
def _attn_program(
    tile_idx, kv_head, split,
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr, limits_ptr,
    scale_log2, num_reqs, num_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, v_scale,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
    Q_FILTER: tl.constexpr, DECODE: tl.constexpr, USE_PDL: tl.constexpr,
    LOOP_STAGES: tl.constexpr, KV_FP8: tl.constexpr, WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, LIMITS: tl.constexpr = False,
):
    """One program: query tile ``tile_idx`` of KV head ``kv_head`` (split ``split``).
    ``LOOP_STAGES`` > 0 pipelines the KV loop that deep (a kernel holding two kinds of
    programs, ``_mixed_attn_kernel``); 0 takes the kernel's ``num_stages``.  ``LIMITS``:
    query token t sees keys up to ``limits_ptr[t]`` (``AttentionMetadata.query_limits``),
    so the tile's key range reaches its largest limit."""

    if DECODE:
        # Decode-only batch: request r's one token is row r (padded empty requests come
        # last, with seq_len 0), so the program is its request: no query_start_loc
        # search.  At batch 1 this kernel's time is its chain of dependent memory round
        # trips, not bandwidth, so the metadata (seq_len here, the first tile's block
        # ids below) is read before the PDL wait (allowed: kernels/pdl.py) and only the
        # query and the KV reads follow it.
        req = tile_idx
        q_start = tile_idx
        q_len = 1
        q_tile = 0
        seq_len = tl.load(seq_lens_ptr + req)
        if seq_len == 0:
            return  # a padded empty request: nothing to attend, its row stays unwritten
    elif Q_FILTER == 3:
        # The decode programs of a one-launch mixed batch: program r is request r (the
        # grid has one per request), which runs only if it is a single-token decode.
        # Request r's query row is query_start_loc[r]: no search.
        req = tile_idx
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        if q_len != 1:
            return  # a prompt chunk (the prompt programs' work) or a padded empty request
        q_tile = 0
        seq_len = tl.load(seq_lens_ptr + req)
        pdl_wait(USE_PDL)
    else:
        if Q_FILTER == 2:
            # Metadata may be read before the PDL wait (kernels/pdl.py): programs past
            # the last real query tile (every tile index of request r lies below
            # query_start_loc[r + 1] // BLOCK_Q + r) exit without searching.
            if tile_idx >= tl.load(qsl_ptr + num_reqs) // BLOCK_Q + num_reqs:
                return
        pdl_wait(USE_PDL)
        req = _find_request(qsl_ptr, tile_idx, num_reqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        q_tile = tile_idx - (q_start // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= q_len:
            return  # surplus program of the upper-bound grid (or a padded empty request)
        if Q_FILTER == 2 and q_len == 1:
            return  # a mixed batch's prompt programs: decodes are the decode programs'
        seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Row r of the tile = query token r // GQA of the tile, query head r % GQA of the group.
    rows = tl.arange(0, BLOCK_M)
    q_in_req = q_tile * BLOCK_Q + rows // GQA
    head = kv_head * GQA + rows % GQA
    row_ok = (rows < BLOCK_Q * GQA) & (q_in_req < q_len)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_in_req).to(tl.int64)
    # Padding rows (a decode's GQA heads fill 4 of its 16 rows) get position -1, so
    # they see no key: their P is 0 and the P@V product runs on zeros instead of on a
    # row of ones.  The results are never stored either way; this is for power: W1 runs
    # at the GPU's power cap, and zero operands cost less energy in the tensor cores
    # (+0.4% W1 throughput, docs/findings.md run 14).
    q_pos = tl.where(row_ok, ctx_len + q_in_req, -1)

    # Keys this tile needs: positions [0, kv_end), kv_end = last query position + 1.
    kv_end = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    q_lim = q_pos
    if LIMITS:  # or the largest key limit of the tile (at most seq_len - 1)
        q_lim = tl.load(limits_ptr + tok, mask=row_ok, other=-1)
        kv_end = tl.maximum(kv_end, tl.max(q_lim, 0) + 1)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tile_start = 0
    if WINDOW > 0:  # tiles wholly behind the tile's first query's window are skipped
        tile_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - WINDOW + 1, 0) // TILE_N
    if SPLIT:
        per_split = tl.cdiv(num_tiles - tile_start, num_splits)
        tile_lo = tile_start + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = tile_start
        tile_hi = num_tiles
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    if DECODE:
        kv_pos0, kv_ok0, block0 = _tile_blocks(tile_lo, kv_end, bt_row, offs_n, BLOCK_SIZE,
                                               TILE_N)
        pdl_wait(USE_PDL)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if KV_FP8 == 2:
        # A bf16 query over an fp8 cache multiplies in fp16: e4m3 -> fp16 is exact and
        # one instruction per two values, e4m3 -> bf16 is not (it goes through fp16 and
        # fp32), and that conversion of every K / V value made the fp8 cache slower than
        # bf16.  fp16 keeps more of q's mantissa than bf16; |q| is clamped to fp16's max.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    qk_scale = scale_log2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], dtype=tl.float32)
    first = tile_lo
    if DECODE:  # the first tile, with its prefetched block ids
        if tile_lo < tile_hi:
            m_i, l_i, acc = _attn_tile_blocks(
                q, q_pos, q_lim, m_i, l_i, acc, kv_pos0, kv_ok0, block0, kv_head_off,
                k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, qk_scale, dims, dim_ok,
                BLOCK_SIZE, F32_DOT, WINDOW, SOFTCAP)
        first = tile_lo + 1
    if WHILE_LOOP:
        # The interpreter cannot use loaded scalars as range() bounds (numpy 2 refuses
        # int() of their shape-(1,) arrays); on the GPU the for-loop is kept because
        # only scf.for loops are software-pipelined (num_stages).
        t = first
        while t < tile_hi:
            m_i, l_i, acc = _attn_tile(
                t, q, q_pos, q_lim, m_i, l_i, acc, kv_end, bt_row, kv_head_off, k_cache_ptr,
                v_cache_ptr, stride_cb, stride_cs, qk_scale, dims, dim_ok, offs_n,
                BLOCK_SIZE, TILE_N, F32_DOT, WINDOW, SOFTCAP)
            t += 1
    elif LOOP_STAGES > 0:
        for t in tl.range(first, tile_hi, num_stages=LOOP_STAGES):
            m_i, l_i, acc = _attn_tile(
                t, q, q_pos, q_lim, m_i, l_i, acc, kv_end, bt_row, kv_head_off, k_cache_ptr,
                v_cache_ptr, stride_cb, stride_cs, qk_scale, dims, dim_ok, offs_n,
                BLOCK_SIZE, TILE_N, F32_DOT, WINDOW, SOFTCAP)
    else:
        for t in range(first, tile_hi):
            m_i, l_i, acc = _attn_tile(
                t, q, q_pos, q_lim, m_i, l_i, acc, kv_end, bt_row, kv_head_off, k_cache_ptr,
                v_cache_ptr, stride_cb, stride_cs, qk_scale, dims, dim_ok, offs_n,
                BLOCK_SIZE, TILE_N, F32_DOT, WINDOW, SOFTCAP)

    if KV_FP8:
        acc = acc * v_scale  # the fp8 cache holds v / v_scale
    if SPLIT:
        # Partials: acc [T, H, S, D] fp32 (unnormalised), m/l [T, H, S]; empty splits
        # store m = -inf, l = 0 so the reduce weighs them 0.
        stat = (tok * num_heads + head) * num_splits + split
        tl.store(m_ptr + stat, m_i, mask=row_ok)
        tl.store(l_ptr + stat, l_i, mask=row_ok)
        tl.store(out_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

# Ints that change from step to step are not specialised on (Triton would otherwise
# compile new variants when one becomes 1 or a multiple of 16 -- mid-run, ~1 s each).
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr, limits_ptr,
    scale_log2, num_reqs, num_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, v_scale,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
    Q_FILTER: tl.constexpr, DECODE: tl.constexpr, USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
    LIMITS: tl.constexpr = False,
):
    pdl_trigger(USE_PDL)
    _attn_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
        block_tables_ptr, seq_lens_ptr, qsl_ptr, limits_ptr, scale_log2, num_reqs,
        num_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        v_scale, GQA, HEAD_DIM, DIM_P2, BLOCK_SIZE, BLOCK_M, BLOCK_Q, TILE_N, SPLIT, F32_DOT,
        WHILE_LOOP, Q_FILTER, DECODE, USE_PDL, 0, KV_FP8, WINDOW, SOFTCAP, LIMITS)


@triton.jit(do_not_specialize=["num_reqs", "num_pre_tiles", "stride_bt"])
def _mixed_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr, limits_ptr,
    scale_log2, num_reqs, num_heads, num_pre_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, v_scale,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    P_BLOCK_M: tl.constexpr, P_BLOCK_Q: tl.constexpr, P_TILE_N: tl.constexpr,
    P_STAGES: tl.constexpr,
    D_BLOCK_M: tl.constexpr, D_BLOCK_Q: tl.constexpr, D_TILE_N: tl.constexpr,
    D_STAGES: tl.constexpr,
    F32_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr, USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
    LIMITS: tl.constexpr = False,
):
    """A mixed batch in one launch: prompt-chunk programs (``num_pre_tiles`` query tiles
    x KV heads, the prompt plan's tiles) come first on the 1-D grid, then the decode
    programs (one per request x KV head, the decode plan's tiles).  The GPU starts
    programs roughly in grid order, so the long prompt programs -- each walks its whole
    context, and a step's few hundred prompt tokens make only about one wave of them --
    run beside the decodes instead of after them, as a second launch's would."""
    pdl_trigger(USE_PDL)
    pid = tl.program_id(0)
    num_pre = num_pre_tiles * NUM_KV_HEADS
    if pid < num_pre:
        _attn_program(
            pid // NUM_KV_HEADS, pid % NUM_KV_HEADS, 0,
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_ptr, out_ptr,
            block_tables_ptr, seq_lens_ptr, qsl_ptr, limits_ptr, scale_log2, num_reqs,
            num_heads, 1,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
            stride_bt, v_scale, GQA, HEAD_DIM, DIM_P2, BLOCK_SIZE, P_BLOCK_M, P_BLOCK_Q,
            P_TILE_N, False, F32_DOT, WHILE_LOOP, 2, False, USE_PDL, P_STAGES, KV_FP8, WINDOW,
            SOFTCAP, LIMITS)
    else:
        d = pid - num_pre
        _attn_program(
            d // NUM_KV_HEADS, d % NUM_KV_HEADS, 0,
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_ptr, out_ptr,
            block_tables_ptr, seq_lens_ptr, qsl_ptr, qsl_ptr, scale_log2, num_reqs,
            num_heads, 1,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
            stride_bt, v_scale, GQA, HEAD_DIM, DIM_P2, BLOCK_SIZE, D_BLOCK_M, D_BLOCK_Q,
            D_TILE_N, False, F32_DOT, WHILE_LOOP, 3, False, USE_PDL, D_STAGES, KV_FP8, WINDOW,
            SOFTCAP)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _reduce_splits_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, qsl_ptr, num_reqs, num_heads, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # The token count is metadata, read before the PDL wait (kernels/pdl.py); the
    # partials are loaded at once after it.  A padding token's partials may be garbage,
    # but its row is never stored.
    real = tok < tl.load(qsl_ptr + num_reqs)
    pdl_wait(USE_PDL)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, DIM_P2)
    split_ok = splits < num_splits
    base = (tok * num_heads + head) * num_splits
    m = tl.load(m_ptr + base + splits, mask=split_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + base + splits, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=(dims < HEAD_DIM) & real)


@dataclass(frozen=True)
class AttentionLaunch:
    """Host-side launch plan: tile shapes, split count and warps.  Build it with
    ``plan_attention`` (heuristic) or by hand (benchmarks, tests forcing a path)."""

    block_m: int  # rows per program = block_q * gqa, padded to a power of two (>= 16)
    block_q: int  # query tokens per program
    tile_n: int  # KV positions per inner-loop step
    num_splits: int  # 1 = single pass; > 1 = split-KV + reduce
    num_warps: int = 4
    num_stages: int = 2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``; 132 (an H100/H200) off-GPU so plans stay stable."""
    if device.type != "cuda" or _interpreting():
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def plan_attention(
    *, num_reqs: int, max_query_len: int, num_heads: int, num_kv_heads: int,
    block_size: int, sm_count: int, num_splits: int | None = None,
    max_seq_len: int | None = None, head_dim: int = 128, beside_decodes: bool = False,
) -> AttentionLaunch:
    """Choose tile shapes and the split count from host ints only.

    * Decode-only batches (``max_query_len == 1``) use BLOCK_M = max(16, GQA) so a
      program's rows are the GQA heads of one token.  When ``num_reqs * num_kv_heads``
      programs cannot fill the GPU (< 1 wave of ``sm_count``), the KV range is split so
      that about ``2 * sm_count`` programs run, up to ``MAX_SPLITS``.  The choice
      depends on ``num_reqs`` but *not* on sequence lengths unless ``max_seq_len`` is
      given, so a CUDA graph captured for a batch size stays valid at any context
      length (empty splits exit after writing a zero-weight partial).
    * Batches with prefill chunks use BLOCK_M = 64 (or the GQA width if larger) and
      never split: long prompts already give many query tiles.

    ``num_splits`` forces the split count (1 = never split), e.g. for tests.
    ``max_seq_len``, when given, turns splitting off for short contexts (<= 4 tiles of
    work per program), which is only safe outside CUDA graphs.  ``head_dim``: the long
    unsplit decode tiles are used only at head sizes they were measured at (<= 128).
    ``beside_decodes``: the plan of the prompt chunks of a mixed batch, whose programs
    share ``_mixed_attn_kernel``'s launch with the decodes (head size 128: longer tiles).
    Every plan compiles for sm_90 within its shared memory, without register spills
    (tests/kernels/test_attention_smem.py: 73 KB for the unsplit Llama-3-8B decode plan).
    """
    gqa = num_heads // num_kv_heads
    decode = max_query_len <= 1
    # Split decodes' tile: TILE_N 64 was best at batch 1 x 8k (kernel_bench sweep, H200,
    # Llama-3-8B shapes, 2026-11-29).
    split_tile_n = max(64, block_size)
    if num_splits is None:
        num_splits = 1
        programs = num_reqs * num_kv_heads
        # Split only when the grid is under one wave: at batch 32 x 2k (256 programs of
        # 8 KV heads) one pass beat two splits in the same sweep, and W1's decode
        # batches of 27-256 requests never gained from 2 or 4 splits (attn_tune --w1).
        if decode and programs < sm_count:
            num_splits = min(MAX_SPLITS, triton.next_power_of_2(
                math.ceil(2 * sm_count / max(programs, 1))))
            if max_seq_len is not None:
                tiles = math.ceil(max_seq_len / split_tile_n)
                num_splits = max(1, min(num_splits, tiles // 4))
    num_stages = 2
    if decode:
        block_m = max(16, triton.next_power_of_2(gqa))
        if num_splits > 1:  # few programs, each a slice of a context
            tile_n = split_tile_n
        else:
            # One program per (request, KV head) over its whole context: a deeper
            # pipeline of larger tiles keeps more bytes in flight per program.  On an
            # H200 at W1's decode batches (attn_tune --w1, 2026-11-30) TILE_N 128 with 3
            # stages took 50 us against 62-65 us at 27 requests, 125 against 130 at 112,
            # and tied at 256.  (Triton's pipeliner keeps one such tile in flight, as
            # each tile's block ids are a load.  Reading the block table into registers
            # in chunks instead, so that 64-position tiles went two deep in 153
            # registers, won 6% in mixed_attn_ab.py's replay but ran W1 2% slower in the
            # engine: 8,715 and 8,726 against 8,905 and 8,878 tok/s, one lease,
            # 2026-12-01.  Removed; docs/findings.md run 12.)
            tile_n = max(128, block_size)
            num_stages = 3
            if head_dim > 128:  # not measured at larger heads: keep the split tiles
                tile_n, num_stages = split_tile_n, 2
    else:
        block_m = max(64, triton.next_power_of_2(gqa))
        # TILE_N 32 for prompt chunks: W1's first step (13 prompts, 8,192 tokens) took
        # 234 us per layer against 274 us with 64 (attn_tune --w1).
        tile_n = max(32, block_size)
        if beside_decodes and head_dim == 128:
            # Beside decodes, a step's few hundred prompt tokens make about one wave of
            # long programs, each a chain of dependent tiles: longer, deeper-pipelined
            # tiles shorten the chains.  W1's mixed steps (throughput policy, replayed by
            # benchmarks/mixed_attn_ab.py, now in git history; H200, 2026-12-01): 2.02,
            # 1.98 and 2.03 s of attention against 2.07, 2.01 and 2.06 s with TILE_N 32
            # and 2 stages.  Shared memory stays near the decode plan's (82 KB against
            # 74 KB: still two programs per multiprocessor).  Other head sizes keep the
            # plan above (not measured).
            tile_n, num_stages = max(64, block_size), 3
    num_warps = 4
    block_q = max(1, block_m // gqa)
    return AttentionLaunch(block_m=block_m, block_q=block_q, tile_n=tile_n,
                           num_splits=max(1, num_splits), num_warps=num_warps,
                           num_stages=num_stages)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, num_reqs: int,
    max_query_len: int, scale: float, out: torch.Tensor | None = None,
    num_splits: int | None = None, launch: AttentionLaunch | None = None,
    max_seq_len: int | None = None, sliding_window: int | None = None,
    soft_cap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    query_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed batch; returns ``[num_tokens, num_heads,
    head_dim]`` in ``query``'s dtype (written into ``out`` if given).

    Args:
      query: ``[num_tokens, num_heads, head_dim]``; last dim contiguous.  Rows of tokens past
        ``query_start_loc[num_reqs]`` (CUDA-graph padding) are left unwritten.
      kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
      block_tables: ``[>= num_reqs, max_blocks]`` int32; seq_lens ``[>= num_reqs]``
        int32; query_start_loc ``[num_reqs + 1]`` int32 -- all on query's device.
      num_reqs, max_query_len: host ints (from the metadata); they and
        ``query.shape[0]`` alone fix the grid.
      num_splits: force the split count (1 = no split-KV); None = heuristic.
      launch: a full launch plan (overrides ``num_splits``).
      max_seq_len: optional host int to let the heuristic skip splitting short
        contexts; leave None under CUDA-graph capture.
      sliding_window, soft_cap: the layer's ``AttentionKind`` (attention/kinds.py), as
        compile-time constants (one variant per distinct value, i.e. at most two per
        model).
      k_scale, v_scale: per-tensor scales of an fp8 ``kv_cache`` (ignored otherwise).
      query_limits: ``[num_tokens]`` int32, the last key position each query sees
        (``AttentionMetadata.query_limits``); None = causal.  Read by the prompt-chunk
        programs only (a one-token query's limit is its position).
    """
    kind: dict[str, float] = dict(WINDOW=int(sliding_window or 0),
                                  SOFTCAP=float(soft_cap or 0.0))
    limits = None
    if query_limits is not None and max_query_len > 1:
        assert query_limits.dtype == torch.int32 and query_limits.device == query.device
        kind["LIMITS"] = True
        limits = query_limits
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert kv_cache.shape[4] == head_dim and kv_cache.stride(4) == 1 and query.stride(2) == 1
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_tokens == 0 or num_reqs == 0:
        return out
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    # KV_FP8: 0 = a cache in the model dtype, 1 = fp8 upcast to q's dtype, 2 = fp8 with
    # a bf16 query multiplied in fp16 (_attn_program: faster than via bf16 on the H200).
    kv_fp8 = 0 if not fp8 else 2 if query.dtype == torch.bfloat16 else 1
    kv = _KVScales(float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0, kv_fp8)
    if launch is None and num_splits is None and max_query_len > 1 and num_reqs > 1:
        # A mixed batch runs its decodes with the decode plan's small tiles (BLOCK_M =
        # the GQA group of one token) and its prompt chunks with 64-row tiles: 64-row
        # tiles for all would give each decode a tile 16x larger than its 4 (GQA) rows,
        # and the decode attention of a step with hundreds of decodes would turn
        # compute-bound.  Both kinds of program share one launch
        # (``_mixed_attn_kernel``), prompt programs first, so that they run beside the
        # decodes: as a second launch they took 1.2 ms of W1's mixed steps of ~450
        # tokens under the throughput policy (~300 prompt tokens in ~150 programs, each
        # walking its whole context: one long wave), on top of 3.7-5.4 ms of decode
        # attention (H200, 2026-12-01).  (A lone request with several tokens is a
        # prompt chunk: it keeps the single launch below.)
        sms = device_sm_count(query.device)
        dec, pre = (plan_attention(num_reqs=num_reqs, max_query_len=mql, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, block_size=block_size,
                                   sm_count=sms, num_splits=1, head_dim=head_dim,
                                   beside_decodes=True)
                    for mql in (1, max_query_len))
        _mixed_launch(query, kv_cache, block_tables, seq_lens, query_start_loc,
                      num_reqs, scale, out, pre, dec, kv, kind, limits)
        return out
    if launch is None:
        launch = plan_attention(
            num_reqs=num_reqs, max_query_len=max_query_len, num_heads=num_heads,
            num_kv_heads=num_kv_heads, block_size=block_size,
            sm_count=device_sm_count(query.device), num_splits=num_splits,
            max_seq_len=max_seq_len, head_dim=head_dim)
    _launch(query, kv_cache, block_tables, seq_lens, query_start_loc, num_reqs, scale, out,
            launch, decode=max_query_len <= 1, kind=kind, kv=kv, limits=limits)
    return out


@dataclass(frozen=True)
class _KVScales:
    """An fp8 cache's scales as the kernels take them (1.0 and 0 for other caches)."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    fp8: int = 0  # the kernels' KV_FP8 (paged_attention): 0, or 1 / 2 for an fp8 cache


def _mixed_launch(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int,
                  scale: float, out: torch.Tensor, pre: AttentionLaunch,
                  dec: AttentionLaunch, kv: _KVScales,
                  kind: dict[str, float] | None = None,
                  limits: torch.Tensor | None = None) -> None:
    """A mixed batch's one launch: prompt programs with plan ``pre``, then decode
    programs with plan ``dec`` (neither splits).  The prompt part has the upper-bound
    count of query tiles ``num_tokens // block_q + num_reqs``, the decode part one
    program per request (host ints only)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    gqa = num_heads // num_kv_heads
    assert pre.num_splits == 1 and dec.num_splits == 1, (pre, dec)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pre_tiles = num_tokens // pre.block_q + num_reqs
    dec_tiles = num_reqs
    _mixed_attn_kernel[((pre_tiles + dec_tiles) * num_kv_heads,)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        query_start_loc if limits is None else limits,
        scale * kv.k_scale * _LOG2E, num_reqs, num_heads, pre_tiles,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        kv.v_scale, GQA=gqa, HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads,
        P_BLOCK_M=pre.block_m, P_BLOCK_Q=pre.block_q, P_TILE_N=pre.tile_n,
        P_STAGES=pre.num_stages, D_BLOCK_M=dec.block_m, D_BLOCK_Q=dec.block_q,
        D_TILE_N=dec.tile_n, D_STAGES=dec.num_stages,
        F32_DOT=_interpreting() or query.dtype == torch.float32,
        WHILE_LOOP=_interpreting(), KV_FP8=kv.fp8,
        num_warps=max(pre.num_warps, dec.num_warps),
        num_stages=max(pre.num_stages, dec.num_stages), **pdl_launch_args(query.device),
        **(kind or {}))


def _launch(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int,
            scale: float, out: torch.Tensor, launch: AttentionLaunch,
            decode: bool = False, kind: dict[str, float] | None = None,
            kv: _KVScales = _KVScales(), limits: torch.Tensor | None = None) -> None:
    """One launch of the kernel (plus the split merge) with plan ``launch`` over every
    request.  ``decode``: every request has one new token (row r is request r's; empty
    padded requests last), so programs map to requests directly."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    gqa = num_heads // num_kv_heads
    assert launch.block_q * gqa <= launch.block_m, launch
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    f32_dot = _interpreting() or query.dtype == torch.float32
    dim_p2 = triton.next_power_of_2(head_dim)
    splits = launch.num_splits
    pdl = pdl_launch_args(query.device)
    if decode:
        grid = (min(num_reqs, num_tokens), num_kv_heads, splits)
    else:
        grid = (num_tokens // launch.block_q + num_reqs, num_kv_heads, splits)
    common = dict(
        GQA=gqa, HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q, TILE_N=launch.tile_n,
        SPLIT=splits > 1, F32_DOT=f32_dot, WHILE_LOOP=_interpreting(), Q_FILTER=0,
        DECODE=decode, KV_FP8=kv.fp8,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages, **pdl, **(kind or {}),
    )
    # num_splits is a runtime argument (only "split or not" is compiled in), so batch
    # sizes that pick different split counts share one compiled kernel.
    args = (block_tables, seq_lens, query_start_loc,
            query_start_loc if limits is None else limits,  # unread without LIMITS
            scale * kv.k_scale * _LOG2E, num_reqs, num_heads, splits, query.stride(0),
            query.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     block_tables.stride(0), kv.v_scale)
    if splits == 1:
        _paged_attn_kernel[grid](
            query, k_cache, v_cache, out, out, out, *args, out.stride(0), out.stride(1),
            *cache_strides, **common)
        return
    # Scratch for the partials; under CUDA-graph capture these come from the graph's
    # private memory pool, so replays reuse them.
    acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32,
                      device=query.device)
    m = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=query.device)
    lse = torch.empty_like(m)
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, acc, m, lse, *args, 0, 0, *cache_strides, **common)
    _reduce_splits_kernel[(num_tokens, num_heads)](
        acc, m, lse, out, query_start_loc, num_reqs, num_heads, splits, out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim, DIM_P2=dim_p2,
        SPLITS_P2=triton.next_power_of_2(splits), num_warps=4 if head_dim >= 128 else 2,
        **pdl)
