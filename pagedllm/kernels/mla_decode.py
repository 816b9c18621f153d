"""Paged multi-head latent attention (DeepSeek MLA) in latent space, for decodes and short
multi-token queries (speculative verification, small chunks), with split-KV
(flash-decoding) for long contexts.

What it computes.  The up-projections are absorbed into the query and the output, so
every head attends over the same per-token latent::

    kv_cache  (1, num_blocks, block_size, 1, L + R)  model dtype or fp8; a token: [c_kv | k_pe]
    q_latent  [T, H, L]      q_pe [T, H, R]          out [T, H, L] (q_latent's dtype)

    s[t, h, j] = (q_latent[t, h] . c_kv[j] + q_pe[t, h] . k_pe[j]) * scale
    out[t, h]  = sum_j softmax_j(s[t, h, :])[j] * c_kv[j]      (values = the latent)

Request ``r`` owns tokens ``query_start_loc[r] .. query_start_loc[r + 1]`` (``q_len``
of them) and ``seq_lens[r]`` tokens of context, new ones included and already written
to the cache; its query ``i`` sits at position ``seq_lens[r] - q_len + i`` and sees
positions ``0 ..`` that one, read through ``block_tables[r]`` (ragged: only the first
``ceil(seq_lens[r] / block_size)`` entries are read).  Rows past
``query_start_loc[num_reqs]`` (a padded batch) are left unwritten.

Grid::

    axis 0: (query block, head block), head blocks fastest: the programs that read the
            same KV (one request's head blocks) run side by side, so the second finds
            it in L2.  A program's rows are BLOCK_Q queries x BLOCK_H heads of one
            request, so each KV tile is loaded ONCE for all its heads and
            queries -- what makes MLA decode bandwidth-bound on the latent cache (one
            576-element row per token serves all H heads).  Both products run as
            ``tl.dot`` with M = BLOCK_Q * BLOCK_H >= 16 rows.  DeepSeek-V2-Lite's 16
            heads fit one head block; V3's 128 split into head blocks of 64 (a 64 x 512
            fp32 accumulator is already 128 registers a thread at 8 warps).
    axis 1: requests.  Queries longer than one token (``max_query_len > 1``: a CUDA
            graph's chunk step, speculative verification) instead put every request's
            query tiles on axis 0, as ``paged_attention.py`` does: a program finds its
            request by binary search over ``query_start_loc`` (tile start
            ``query_start_loc[r] // BLOCK_Q + r``), and the grid is the upper bound
            ``num_tokens // BLOCK_Q + num_reqs`` tiles (axis 1 is 1).
    axis 2: KV splits.  Split ``s`` of ``S`` takes a contiguous, BLOCK_N-aligned run of
            the positions its rows need, writes its normalised partial output and its
            log-sum-exp (log2 domain), and ``_mla_reduce_kernel`` merges the S partials.
            ``S`` is a host int (from the batch size, never from device tensors): a CUDA
            graph captured for a batch size stays valid at any context length; empty
            splits write a zero-weight partial.

Inside a program: online softmax in the log2 domain, fp32 accumulation, P cast to the
values' dtype for the P @ c_kv product (as FlashAttention does).  Every offset built from
a block id or a token index is int64.

An fp8 cache (``kv_cache_dtype="fp8"``, e4m3) holds ``[c_kv | k_pe] / k_scale``, one
per-layer scale for the whole entry (``attention/mla_torch.py``).  It is dequantised in
registers: each tile is upcast to the query's dtype as it is loaded (exact: e4m3 fits
fp16 / bf16 / fp32), and ``* k_scale`` is applied where it costs one multiply, not one
per element -- folded into the softmax scale on the host (both score terms, latent and
rope, carry it) and into the output once before it is stored (the values are the
latent; split partials are linear in them, so the merge needs no scale).  That equals
attention over ``entry * k_scale`` up to fp32 rounding.  A bf16 query over an fp8 cache
multiplies in fp16, as ``paged_attention.py`` does (``KV_FP8 == 2``): e4m3 -> fp16 is one
instruction per two values, e4m3 -> bf16 is not; bf16 queries convert to fp16 exactly
unless they fall below fp16's normal range (or are clamped at +-65504).

Under ``TRITON_INTERPRET=1`` both products upcast to fp32 (the interpreter's bf16
``tl.dot`` returns garbage in triton 3.6; the upcast of bf16 is exact, so the numerics
are the GPU's up to accumulation order).  fp32 inputs multiply in IEEE fp32, not TF32.

:func:`mla_decode_ref` is the oracle: a per-request dense softmax in fp32 (over the
dequantised entries, ``fp8.float() * k_scale``, for an fp8 cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The GQA kernel's helpers: the same MMA numerics, tile search and interpreter test.
from pagedllm.kernels.paged_attention import _LOG2E, _find_request, _interpreting, _mma

MAX_SPLITS = 32
# Multi-token queries up to this length (speculative verification) share their
# program's KV tiles; longer ones (chunk steps) run one query a program (plan_mla_decode).
MAX_TILED_QUERY_LEN = 8
# Query dtypes the kernel takes over an fp8 cache.
_FP8_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _mla_tile(start, kv_hi, q_lat, q_rope, q_pos, m_i, l_i, acc, kv_ptr, bt_row,
              stride_kvb, stride_kvs, scale_log2, offs_n, offs_l, offs_r, l_ok, r_ok,
              L: tl.constexpr, BLOCK_SIZE: tl.constexpr, F32_DOT: tl.constexpr):
    """Positions ``start .. start + BLOCK_N`` (below ``kv_hi``) of the online softmax:
    one gather of their ``[c_kv | k_pe]`` rows serves every row (query x head)."""
    pos = start + offs_n
    pos_ok = pos < kv_hi
    block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    base = block_id * stride_kvb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kvs
    # .to(q's dtype): a no-op for a cache in the model dtype, fp8's (exact) upcast; its
    # k_scale is in scale_log2 and in the caller's final multiply.
    c_kv = tl.load(kv_ptr + base[:, None] + offs_l[None, :],
                   mask=pos_ok[:, None] & l_ok[None, :], other=0.0).to(q_lat.dtype)
    k_pe = tl.load(kv_ptr + base[:, None] + L + offs_r[None, :],
                   mask=pos_ok[:, None] & r_ok[None, :], other=0.0).to(q_rope.dtype)
    s = _mma(q_lat, tl.trans(c_kv), F32_DOT) + _mma(q_rope, tl.trans(k_pe), F32_DOT)
    s = s * scale_log2
    visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(c_kv.dtype), c_kv, F32_DOT)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "num_reqs"])
def _mla_decode_kernel(
    ql_ptr, qp_ptr, kv_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr,
    scale_log2, kv_scale, num_heads, num_splits, num_reqs,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_kvb, stride_kvs, stride_bt,
    stride_ot, stride_oh,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr, KV_FP8: tl.constexpr,
    SEARCH: tl.constexpr,
):
    h_block = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(2)
    if SEARCH:  # query tiles of all requests on axis 0 (module doc, "Grid")
        tile_idx = tl.program_id(0) // HEAD_BLOCKS
        if tile_idx >= tl.load(qsl_ptr + num_reqs) // BLOCK_Q + num_reqs:
            return  # past the last real tile of the upper-bound grid
        req = _find_request(qsl_ptr, tile_idx, num_reqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        q_block = tile_idx - (q_start // BLOCK_Q + req)
    else:
        req = tl.program_id(1)
        q_block = tl.program_id(0) // HEAD_BLOCKS
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # a surplus program (a shorter request, a padded empty one)
    seq_len = tl.load(seq_lens_ptr + req)

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q_block * BLOCK_Q + rows // BLOCK_H
    head = h_block * BLOCK_H + rows % BLOCK_H
    row_ok = (qi < q_len) & (head < num_heads)
    q_pos = seq_len - q_len + qi  # the last position each row may see (causal)
    tok = (q_start + qi).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L
    r_ok = offs_r < R
    q_lat = tl.load(ql_ptr + tok[:, None] * stride_qlt + head[:, None] * stride_qlh
                    + offs_l[None, :], mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    q_rope = tl.load(qp_ptr + tok[:, None] * stride_qpt + head[:, None] * stride_qph
                     + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if KV_FP8 == 2:  # a bf16 query over an fp8 cache multiplies in fp16 (module doc)
        q_lat = tl.clamp(q_lat.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_rope = tl.clamp(q_rope.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Positions this program's rows need: up to its last query's position.  The split's
    # share is rounded up to whole tiles so that only the last tile of a split is ragged.
    kv_end = tl.minimum(seq_len, seq_len - q_len + q_block * BLOCK_Q + BLOCK_Q)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_L], dtype=tl.float32)
    if WHILE_LOOP:
        # The interpreter cannot take loaded scalars as range() bounds (numpy 2 refuses
        # int() of their shape-(1,) arrays); on the GPU the for-loop stays, as only
        # scf.for loops are software-pipelined (num_stages).
        start = kv_lo
        while start < kv_hi:
            m_i, l_i, acc = _mla_tile(
                start, kv_hi, q_lat, q_rope, q_pos, m_i, l_i, acc, kv_ptr, bt_row,
                stride_kvb, stride_kvs, scale_log2, offs_n, offs_l, offs_r, l_ok, r_ok,
                L, BLOCK_SIZE, F32_DOT)
            start += BLOCK_N
    else:
        for start in range(kv_lo, kv_hi, BLOCK_N):
            m_i, l_i, acc = _mla_tile(
                start, kv_hi, q_lat, q_rope, q_pos, m_i, l_i, acc, kv_ptr, bt_row,
                stride_kvb, stride_kvs, scale_log2, offs_n, offs_l, offs_r, l_ok, r_ok,
                L, BLOCK_SIZE, F32_DOT)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * kv_scale  # the fp8 cache holds c_kv / k_scale
    if SPLIT:
        # Partials [T, S, H, L] fp32 and lse [T, S, H]; an empty split (or a row that
        # sees nothing in it) has l = 0 -> lse = -inf: zero weight in the merge.
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                       float("-inf"))
        idx = (tok * num_splits + split) * num_heads + head
        tl.store(lse_ptr + idx, lse, mask=row_ok)
        tl.store(out_ptr + idx[:, None] * L + offs_l[None, :], o,
                 mask=row_ok[:, None] & l_ok[None, :])
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_l[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & l_ok[None, :])


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _mla_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, qsl_ptr, num_reqs, num_heads, num_splits,
    stride_ot, stride_oh,
    L: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_reqs):
        return  # a padding row: never written by the split pass either
    splits = tl.arange(0, SPLITS_P2)
    offs_l = tl.arange(0, BLOCK_L)
    split_ok = splits < num_splits
    idx = (tok * num_splits + splits) * num_heads + head
    lse = tl.load(lse_ptr + idx, mask=split_ok, other=float("-inf"))
    part = tl.load(part_ptr + idx[:, None] * L + offs_l[None, :],
                   mask=split_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_l,
             o.to(out_ptr.dtype.element_ty), mask=offs_l < L)


@dataclass(frozen=True)
class MlaLaunch:
    """Host-side launch plan (``plan_mla_decode``, or by hand in tests and sweeps)."""

    block_h: int  # heads per program (power of two; rows = block_q * block_h >= 16)
    block_q: int  # query tokens per program
    block_n: int  # KV positions per inner-loop step
    num_splits: int  # 1 = one pass; > 1 = split-KV + reduce
    num_warps: int = 4
    num_stages: int = 2


def plan_mla_decode(*, num_reqs: int, max_query_len: int, num_heads: int,
                    kv_lora_rank: int, sm_count: int = 132,
                    num_splits: int | None = None,
                    max_seq_len: int | None = None, kv_fp8: bool = False) -> MlaLaunch:
    """Tile shapes and the split count from host ints only (CUDA-graph safe unless
    ``max_seq_len`` is given, which only lowers the split count for short contexts).

    Rows per program are capped at 64 (at the 512-wide latent a 64 x 512 fp32
    accumulator is 128 registers a thread at 8 warps); heads fill the rows first, so a
    decode of DeepSeek-V2-Lite's 16 heads is one 16-row program per request and
    two-token queries share one 32-row program.  Launches for queries longer than
    ``MAX_TILED_QUERY_LEN`` tokens (a chunk step, whose CUDA graph plans with its token
    count) run one query a program: such a step mixes one-token decodes, which a
    multi-query tile would pad, with prompt chunks (H100, DeepSeek-V2-Lite W1: 7,592
    output tok/s against 7,090 / 7,115 with 4-query tiles; a lone 512-token prompt's
    TTFT 18.19 against 17.69 ms).  When the (request, query block, head
    block) programs cannot fill two per multiprocessor (the decode plan's registers
    allow two), each context is split into ``2 * sm_count // programs`` parts (up to
    ``MAX_SPLITS``): all resident in one wave, and no more partials than that to write
    and merge (batch 64 x 16 heads on 132 SMs: 4 splits, 16 MB of fp32 partials
    written and read beside 302 MB of cache).  ``num_splits`` forces the count (tests, sweeps).

    An fp8 cache (``kv_fp8``) needs more registers for the upcast tiles: sm_90 compiles
    (``tests/kernels/test_deepseek_kernels_sm90.py``) spilled at 64 rows x 512 with 8 or
    16 warps and at 16 rows with 4 warps, and fit at up to 32 rows with 8 warps -- so
    rows are capped at 32 (V3's 128 heads: four head blocks) and 8 warps start at 16
    rows x 512."""
    max_rows = 64 if kv_lora_rank <= 512 and not kv_fp8 else 32
    block_h = min(max(16, triton.next_power_of_2(num_heads)), max_rows)
    block_q = 1 if max_query_len > MAX_TILED_QUERY_LEN else max(
        1, min(triton.next_power_of_2(max(1, max_query_len)), max_rows // block_h))
    head_blocks = -(-num_heads // block_h)
    q_blocks = -(-max(1, max_query_len) // block_q)
    block_n = 32 if kv_lora_rank >= 256 else 64
    if num_splits is None:
        programs = max(1, num_reqs * q_blocks * head_blocks)
        num_splits = 1
        if programs < 2 * sm_count:
            num_splits = min(MAX_SPLITS, 2 * sm_count // programs)
        if max_seq_len is not None:  # at least 4 tiles of work per split
            num_splits = max(1, min(num_splits, math.ceil(max_seq_len / block_n) // 4))
    rows = block_q * block_h
    warps = 8 if rows * kv_lora_rank >= (16 if kv_fp8 else 32) * 512 else 4
    return MlaLaunch(block_h=block_h, block_q=block_q, block_n=block_n,
                     num_splits=max(1, num_splits), num_warps=warps, num_stages=2)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, max_query_len: int, *,
               launch: MlaLaunch | None = None, max_seq_len: int | None = None,
               out: torch.Tensor | None = None, k_scale: float = 1.0) -> torch.Tensor:
    """Latent-space paged MLA (module doc) -> ``out [T, H, L]`` in ``q_latent``'s dtype.

    ``q_latent [T, H, L]`` and ``q_pe [T, H, R]``: any token / head strides, last dim
    contiguous, the cache's dtype (an fp8 cache: both fp32, bf16 or fp16, one dtype).
    ``kv_cache (1, num_blocks, block_size, 1, L + R)``, last dim contiguous; ``k_scale``:
    an fp8 cache's per-layer scale (a host float, ignored for other caches).
    ``block_tables [num_reqs, max_blocks]``, ``seq_lens [num_reqs]`` and
    ``query_start_loc [num_reqs + 1]`` int32 on the same device;
    ``max_query_len`` a host int >= every request's query length.  ``launch``: a plan
    by hand (else :func:`plan_mla_decode`); ``out``: a preallocated ``[T, H, L]``
    (token / head strides free, last dim contiguous)."""
    t, h, lat = q_latent.shape
    rope = q_pe.shape[-1]
    if q_pe.shape[:2] != (t, h) or kv_cache.dim() != 5 or kv_cache.shape[0] != 1 \
            or kv_cache.shape[3] != 1 or kv_cache.shape[4] != lat + rope:
        raise ValueError(f"mla_decode: q_latent {tuple(q_latent.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, kv_cache {tuple(kv_cache.shape)}: expected "
                         "[T, H, L], [T, H, R], (1, num_blocks, block_size, 1, L + R)")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8:
        if q_pe.dtype != q_latent.dtype or q_latent.dtype not in _FP8_QUERY_DTYPES:
            raise ValueError(f"mla_decode: over an fp8 cache q_latent {q_latent.dtype} and "
                             f"q_pe {q_pe.dtype} must share one dtype of float32, bfloat16 "
                             "or float16")
    elif q_latent.dtype != kv_cache.dtype or q_pe.dtype != kv_cache.dtype:
        raise ValueError(f"mla_decode: q_latent {q_latent.dtype} and q_pe {q_pe.dtype} must "
                         f"have the cache's dtype {kv_cache.dtype}")
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("mla_decode: q_latent, q_pe and kv_cache need a contiguous last dim")
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(t, h, lat, dtype=q_latent.dtype, device=q_latent.device)
    if t == 0 or num_reqs == 0:
        return out
    if launch is None:
        sm = 132
        if q_latent.is_cuda and not _interpreting():
            from pagedllm.kernels.paged_attention import device_sm_count

            sm = device_sm_count(q_latent.device)
        launch = plan_mla_decode(num_reqs=num_reqs, max_query_len=max_query_len,
                                 num_heads=h, kv_lora_rank=lat, sm_count=sm,
                                 max_seq_len=max_seq_len, kv_fp8=fp8)
    head_blocks = -(-h // launch.block_h)
    q_blocks = -(-max(1, max_query_len) // launch.block_q)
    splits = launch.num_splits
    f32_dot = _interpreting() or q_latent.dtype == torch.float32
    # KV_FP8: 0 = a cache in the model dtype, 1 = fp8 upcast to q's dtype, 2 = fp8 with a
    # bf16 query, both multiplied in fp16 (module doc).
    kv_fp8 = 0 if not fp8 else 2 if q_latent.dtype == torch.bfloat16 else 1
    kv_scale = float(k_scale) if fp8 else 1.0
    # tl.dot needs K >= 16 on the GPU: small latent / rope widths (tiny test models) are
    # padded and masked.
    block_l = max(16, triton.next_power_of_2(lat))
    if splits > 1:
        part = torch.empty(t, splits, h, lat, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(t, splits, h, dtype=torch.float32, device=q_latent.device)
        target, stride_ot, stride_oh = part, 0, 0
    else:
        lse = seq_lens  # unused
        target, stride_ot, stride_oh = out, out.stride(0), out.stride(1)
    # Multi-token queries: one program per query tile of any request, found by search
    # (``num_tokens // BLOCK_Q + num_reqs`` tiles at most), not max_query_len's tiles for
    # every request -- a CUDA graph's chunk step (a 1,024-token graph with 256 request
    # slots) would otherwise launch 65k programs, nearly all exiting at once.
    search = max_query_len > 1
    grid = ((t // launch.block_q + num_reqs) * head_blocks, 1, splits) if search \
        else (q_blocks * head_blocks, num_reqs, splits)
    _mla_decode_kernel[grid](
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, target, lse,
        scale * kv_scale * _LOG2E, kv_scale, h, splits, num_reqs,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        stride_ot, stride_oh,
        L=lat, R=rope, BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=launch.block_h, BLOCK_Q=launch.block_q, HEAD_BLOCKS=head_blocks,
        BLOCK_N=launch.block_n, BLOCK_SIZE=kv_cache.shape[2], SPLIT=splits > 1,
        F32_DOT=f32_dot, WHILE_LOOP=_interpreting(), KV_FP8=kv_fp8, SEARCH=search,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    if splits > 1:
        _mla_reduce_kernel[(t, h)](
            part, lse, out, query_start_loc, num_reqs, h, splits, out.stride(0),
            out.stride(1), L=lat, BLOCK_L=block_l,
            SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
    return out


def mla_decode_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, scale: float,
                   max_query_len: int | None = None, k_scale: float = 1.0) -> torch.Tensor:
    """The oracle of :func:`mla_decode` (same contract): per request, gather the
    context through the block table (an fp8 cache's entries dequantised,
    ``fp8.float() * k_scale``), dense causal softmax in fp32, output in ``q_latent``'s
    dtype.  A python loop over requests: obviously right, not fast."""
    del max_query_len  # same signature as the kernel; the loop needs no bound
    t, h, lat = q_latent.shape
    bs = kv_cache.shape[2]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache[0, :, :, 0, :]  # [num_blocks, block_size, L + R]
    if fp8:  # gathered as bytes (fp8 indexing kernels are not everywhere)
        cache = cache.view(torch.uint8)
    out = torch.zeros(t, h, lat, dtype=q_latent.dtype, device=q_latent.device)
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = qsl[r], qsl[r + 1]
        if hi == lo:
            continue
        n_blocks = -(-seq_len // bs)
        ctx = cache[block_tables[r, :n_blocks].long()].reshape(-1, cache.shape[-1])
        ctx = ctx[:seq_len]
        ctx = ctx.view(torch.float8_e4m3fn).float() * k_scale if fp8 else ctx.float()
        c_kv, k_pe = ctx[:, :lat], ctx[:, lat:]
        ql, qp = q_latent[lo:hi].float(), q_pe[lo:hi].float()  # [q, H, *]
        s = (torch.einsum("qhl,jl->qhj", ql, c_kv)
             + torch.einsum("qhr,jr->qhj", qp, k_pe)) * scale
        q_pos = seq_len - (hi - lo) + torch.arange(hi - lo, device=s.device)
        visible = torch.arange(seq_len, device=s.device)[None, :] <= q_pos[:, None]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        out[lo:hi] = torch.einsum("qhj,jl->qhl", s.softmax(-1), c_kv).to(out.dtype)
    return out
