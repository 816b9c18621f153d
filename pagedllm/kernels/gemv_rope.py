"""Batch-1 decode QKV projection with rotary embedding and the KV-cache write in its
epilogue: one launch instead of the GEMV plus ``rotary.rotary_and_write_kv``.

What it computes, for one token with ``qkv = x W^T (+ b)`` laid out ``[q | k | v]`` by
heads of ``head_dim``:

* q heads: rotated (neox pairs ``(i, i + head_dim/2)``), written to ``out``'s q columns;
* k heads: rotated, written to the key cache at ``slot_mapping[0]``;
* v heads: written to the value cache at that slot (nothing is stored when the slot
  is -1, a CUDA-graph padding row).

``out``'s k and v columns are left unwritten: attention reads keys and values from the
cache.  ``lora`` (an adapter's delta: ``kernels/lora.lora_shrink`` ran the shrink, the
expand is this kernel's, as in ``kernels/gemv.py``) is added to the rounded projection
and rounded again, as the unfused path's in-place LoRA add does, before the rotation and
the cache write.  Every value is rounded exactly as
the unfused path rounds it (the projection to the activation dtype first, then
``rotary._rope``'s per-product rounding), so the cache and the rotated queries are
bit-identical to ``gemv`` + ``rotary_and_write_kv``.

Layout: as in ``kernels/gemv.py`` each program walks the whole K dimension for its rows,
but its ``2 * PAIRS`` rows are ``PAIRS`` rotation pairs of one head, interleaved
``(c, c + half, c + 1, c + 1 + half, ...)``, so the epilogue has both halves of each pair
in registers.  Only full neox rotary (``rot_dim == head_dim``) is handled; other models
keep the unfused path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import (
    _load_w,
    _lora_add,
    _lora_bt,
    _lora_launch,
    _lora_partials,
    _row_dots,
)
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait
from pagedllm.kernels.rotary import _cos_sin, _rope

if TYPE_CHECKING:
    from pagedllm.kernels.gemv import GemvLoRA

PAIRS = 4  # rotation pairs per program: 8 rows, as gemv_config's BLOCK_N


@triton.jit
def _gemv_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    ls_ptr, lt_ptr, lb_ptr, stride_wn, stride_c, stride_cb, stride_cs, stride_ch,
    stride_lb, B1, B2,
    K: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_LORA: tl.constexpr = False, LORA_R: tl.constexpr = 1, LORA_SR: tl.constexpr = 1,
    LORA_SPLIT: tl.constexpr = 1, LORA_BLOCK_R: tl.constexpr = 1,
):
    pdl_trigger(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    PROGS_PER_HEAD: tl.constexpr = HALF // PAIRS
    pid = tl.program_id(0)
    head = pid // PROGS_PER_HEAD
    c0 = (pid % PROGS_PER_HEAD) * PAIRS
    idx = tl.arange(0, 2 * PAIRS)
    col = c0 + idx // 2 + (idx % 2) * HALF  # column within the head, pairs interleaved
    rn = head * HEAD_DIM + col  # the grid covers the rows exactly: no masks
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    # Before the PDL wait: the first weight tile, and this step's position, slot and
    # cos/sin (step metadata, written only by host copies before the forward -- see
    # kernels/pdl.py), so the epilogue's inputs are not a chain of round trips after
    # the K loop.
    w0 = _load_w(w_rows, rk, K, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)
    slot = tl.load(slot_ptr).to(tl.int64)
    i = c0 + tl.arange(0, PAIRS)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, stride_c, 0, i, i < HALF, out_ptr, HALF)
    if HAS_LORA:  # the adapter's Bt tile for these rows (one head: one shard)
        lb, lrows, lhas = _lora_bt(ls_ptr, lb_ptr, stride_lb, rn, head * HEAD_DIM,
                                   (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, B1, B2,
                                   LORA_R, LORA_BLOCK_R)
    pdl_wait(USE_PDL)
    if HAS_LORA:  # the shrink's partials: written by the kernel before
        lp = _lora_partials(lt_ptr, lrows, LORA_R, LORA_SR, LORA_SPLIT, LORA_BLOCK_R)
    acc_out = _row_dots(x_ptr, w_rows, w0, rk, K, False, 2 * PAIRS, BLOCK_K)
    if HAS_BIAS:
        acc_out += bias
    y = acc_out.to(out_ptr.dtype.element_ty)  # the projection's rounding, as gemv's
    if HAS_LORA:
        y = _lora_add(y, lb, lp, lhas)
    x1, x2 = tl.split(tl.reshape(y, (PAIRS, 2)))
    r1, r2 = _rope(x1[None, :], x2[None, :], cos, sin)
    rotated = tl.reshape(tl.join(r1, r2), (2 * PAIRS,))

    if head < NUM_Q_HEADS:
        tl.store(out_ptr + rn, rotated)
    elif slot >= 0:  # slot -1: a CUDA-graph padding row, nothing to store
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            kvh = head - NUM_Q_HEADS
            tl.store(k_cache_ptr + dst + kvh * stride_ch + col,
                     rotated.to(k_cache_ptr.dtype.element_ty))
        else:
            kvh = head - NUM_Q_HEADS - NUM_KV_HEADS
            tl.store(v_cache_ptr + dst + kvh * stride_ch + col,
                     y.to(v_cache_ptr.dtype.element_ty))


def qkv_rope_supported(head_dim: int, rot_dim: int) -> bool:
    """Whether :func:`gemv_qkv_rope` handles this head shape (full neox rotary, heads a
    whole number of programs)."""
    return rot_dim == head_dim and head_dim % (2 * PAIRS) == 0


def gemv_qkv_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
    out: torch.Tensor | None = None, lora: GemvLoRA | None = None,
) -> torch.Tensor:
    """``x: [1, K]`` (contiguous), ``weight: [(Hq + 2 Hkv) * D, K]`` (rows contiguous),
    ``bias`` of that many rows or None; ``positions``/``slot_mapping``: this token's
    (element 0 is used); ``cos_sin_cache: [max_pos, D]`` (``rotary``'s layout);
    ``kv_cache``: one layer's ``[2, num_blocks, block_size, Hkv, D]``.

    Returns ``out`` (``[1, (Hq + 2 Hkv) * D]`` in x's dtype) with the rotated q in its
    first ``Hq * D`` columns; the rotated k and the v go to the cache only.  ``lora``: an
    adapter's delta (``kernels/lora.lora_shrink``) added before the rotation (see the
    module doc); its shard bounds must be whole heads."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or not x.is_contiguous() or weight.stride(1) != 1:
        raise ValueError(f"gemv_qkv_rope: x {tuple(x.shape)} must be one contiguous row "
                         f"matching weight {(n, k)}")
    if n != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"gemv_qkv_rope: weight has {n} rows, expected "
                         f"({num_heads} + 2 x {num_kv_heads}) x {head_dim}")
    if not qkv_rope_supported(head_dim, cos_sin_cache.shape[-1]):
        raise ValueError(f"gemv_qkv_rope: head_dim {head_dim} with rotary dim "
                         f"{cos_sin_cache.shape[-1]} is not supported")
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.stride(4) == 1
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim
    assert cos_sin_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if lora is not None:
        assert all(b % head_dim == 0 for b in lora.bounds), "LoRA shards: whole heads"
    lora_args, lora_consts = _lora_launch(lora, n, out)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_k = min(512, triton.next_power_of_2(k))
    _gemv_qkv_rope_kernel[(n // (2 * PAIRS),)](
        x, weight, bias if bias is not None else weight, out, positions, cos_sin_cache,
        k_cache, v_cache, slot_mapping, *lora_args[:3],
        weight.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *lora_args[3:],
        K=k, NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2], HAS_BIAS=bias is not None, PAIRS=PAIRS,
        BLOCK_K=block_k, num_warps=4, **lora_consts, **pdl_launch_args(x.device))
    return out
