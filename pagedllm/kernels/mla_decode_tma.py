"""MLA decode (one query token per request) with the cache pages read by the tensor
memory accelerator: an experiment beside ``mla_decode.py``'s gather kernel.

Why.  The gather kernel holds at 2.4 TB/s on the H100 and the H200 alike: each SM's
rate, not HBM, limits it (docs/benchmarks.md), and no tile, split, warp or stage count
changed that.  Its loads are per-position gathers through the block table: compiled for
sm_90 at its default plan they are 16-byte ``cp.async`` copies, 18 a thread for each
32-position tile, each with its own address arithmetic (pipelined two stages deep).
Here a page of the cache (``block_size`` consecutive tokens, contiguous in memory) is
one TMA box, addressed by its block id: three bulk copies a page for the whole program,
issued a page ahead by the software pipeline (``num_stages`` >= 2; the compile test
checks it), leaving the issue slots to the math -- the way FlashMLA streams pages.

What it computes is ``mla_decode``'s contract for ``max_query_len == 1`` over a cache in
the query's dtype (bf16 / fp16 / fp32) with ``kv_lora_rank`` 512 and a block size of 16
to 256: one program per (head block, request, split), a page per loop step, the latent
split into two 256-wide halves (a TMA box is at most 256 elements a side)::

    s   = q_lat[:, :256] . c_kv[:, :256]^T + q_lat[:, 256:] . c_kv[:, 256:]^T
          + q_pe . k_pe^T                                   [BLOCK_H, page]
    acc = [acc_lo | acc_hi] += softmax-weighted [c_kv[:, :256] | c_kv[:, 256:]]

It writes the gather kernel's split partials and log-sum-exps (its reduce kernel merges
them), or the output directly with one split.  A split takes a contiguous run of pages.
``mla_decode`` takes this path when the launch plan says ``tma=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.paged_attention import _mma

HALF = 256  # a TMA box side's limit, in elements


def tma_applies(q_latent: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int) -> bool:
    """Whether this kernel takes the call (else the gather kernel does)."""
    lat = q_latent.shape[-1]
    bs = kv_cache.shape[2]
    return (max_query_len == 1 and lat == 2 * HALF and kv_cache.dtype == q_latent.dtype
            and 16 <= bs <= 256 and bs & (bs - 1) == 0
            and kv_cache.shape[-1] - lat in (16, 32, 64, 128)
            and kv_cache.data_ptr() % 16 == 0
            and all(s * kv_cache.element_size() % 16 == 0 for s in kv_cache.stride()[1:3]))


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_tma_kernel(
    ql_ptr, qp_ptr, c_desc, pe_desc, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr,
    scale_log2, num_heads, num_splits,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_bt, stride_ot, stride_oh,
    L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    H2: tl.constexpr = L // 2
    h_block = tl.program_id(0) % HEAD_BLOCKS
    req = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_start:
        return  # a padded request with no query
    seq_len = tl.load(seq_lens_ptr + req)
    head = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = head < num_heads
    tok = q_start.to(tl.int64)
    offs_h2 = tl.arange(0, H2)
    offs_r = tl.arange(0, R)
    q_base = ql_ptr + tok * stride_qlt + head[:, None] * stride_qlh
    q_lo = tl.load(q_base + offs_h2[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_base + H2 + offs_h2[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(qp_ptr + tok * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                   mask=row_ok[:, None], other=0.0)

    n_pages = tl.cdiv(seq_len, PAGE)
    if SPLIT:
        per_split = tl.cdiv(n_pages, num_splits)
        p_lo = split * per_split
        p_hi = tl.minimum(p_lo + per_split, n_pages)
    else:
        p_lo = 0
        p_hi = n_pages
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    offs_p = tl.arange(0, PAGE)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_H, H2], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, H2], dtype=tl.float32)
    if WHILE_LOOP:  # the interpreter cannot take loaded scalars as range() bounds
        pg = p_lo
        while pg < p_hi:
            m_i, l_i, acc_lo, acc_hi = _page(
                pg, bt_row, c_desc, pe_desc, q_lo, q_hi, q_pe, seq_len, offs_p, scale_log2,
                m_i, l_i, acc_lo, acc_hi, H2, R, PAGE, F32_DOT)
            pg += 1
    else:
        for pg in range(p_lo, p_hi):
            m_i, l_i, acc_lo, acc_hi = _page(
                pg, bt_row, c_desc, pe_desc, q_lo, q_hi, q_pe, seq_len, offs_p, scale_log2,
                m_i, l_i, acc_lo, acc_hi, H2, R, PAGE, F32_DOT)

    inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    o_lo = acc_lo * inv[:, None]
    o_hi = acc_hi * inv[:, None]
    if SPLIT:  # the gather kernel's partial layout: [T, S, H, L] fp32, lse [T, S, H]
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                       float("-inf"))
        idx = (tok * num_splits + split) * num_heads + head
        tl.store(lse_ptr + idx, lse, mask=row_ok)
        base = out_ptr + idx[:, None] * L + offs_h2[None, :]
        tl.store(base, o_lo, mask=row_ok[:, None])
        tl.store(base + H2, o_hi, mask=row_ok[:, None])
    else:
        base = out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_h2[None, :]
        tl.store(base, o_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(base + H2, o_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _page(pg, bt_row, c_desc, pe_desc, q_lo, q_hi, q_pe, seq_len, offs_p, scale_log2,
          m_i, l_i, acc_lo, acc_hi, H2: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
          F32_DOT: tl.constexpr):
    """One page of the online softmax: three TMA boxes (latent halves, rope key)."""
    block = tl.load(bt_row + pg)
    c_lo = c_desc.load([block, 0, 0]).reshape(PAGE, H2)
    c_hi = c_desc.load([block, 0, H2]).reshape(PAGE, H2)
    k_pe = pe_desc.load([block, 0, 2 * H2]).reshape(PAGE, R)
    s = (_mma(q_lo, tl.trans(c_lo), F32_DOT) + _mma(q_hi, tl.trans(c_hi), F32_DOT)
         + _mma(q_pe, tl.trans(k_pe), F32_DOT)) * scale_log2
    s = tl.where((pg * PAGE + offs_p)[None, :] < seq_len, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(c_lo.dtype)
    acc_lo = acc_lo * alpha[:, None] + _mma(pv, c_lo, F32_DOT)
    acc_hi = acc_hi * alpha[:, None] + _mma(pv, c_hi, F32_DOT)
    return m_new, l_i, acc_lo, acc_hi


def launch_tma(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale_log2: float, *, block_h: int,
               num_splits: int, num_warps: int, num_stages: int, target: torch.Tensor,
               lse: torch.Tensor, stride_ot: int, stride_oh: int, f32_dot: bool,
               interpreting: bool) -> None:
    """Launch over ``seq_lens.shape[0]`` requests (``tma_applies`` held); ``target``:
    the output, or the ``[T, S, H, L]`` fp32 partials with ``num_splits > 1``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    h, lat = q_latent.shape[1], q_latent.shape[2]
    rope = q_pe.shape[-1]
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    cache = kv_cache[0, :, :, 0, :]  # [num_blocks, block_size, L + R]
    shape, strides = [nb, bs, lat + rope], [cache.stride(0), cache.stride(1), 1]
    c_desc = TensorDescriptor(cache, shape, strides, [1, bs, lat // 2])
    pe_desc = TensorDescriptor(cache, shape, strides, [1, bs, rope])
    head_blocks = -(-h // block_h)
    _mla_tma_kernel[(head_blocks, seq_lens.shape[0], num_splits)](
        q_latent, q_pe, c_desc, pe_desc, block_tables, seq_lens, query_start_loc, target,
        lse, scale_log2, h, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        block_tables.stride(0), stride_ot, stride_oh,
        L=lat, R=rope, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks, PAGE=bs,
        SPLIT=num_splits > 1, F32_DOT=f32_dot, WHILE_LOOP=interpreting,
        num_warps=num_warps, num_stages=num_stages)
