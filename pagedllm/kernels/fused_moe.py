"""Fused mixture-of-experts on the GPU: tokens sorted by expert, two grouped GEMMs.

```
 topk_ids [T, k] ──moe_align──► sorted_ids: pair ids grouped by expert, each expert's run
                                 padded to a multiple of BLOCK_M (pad = P, "no pair")
                                 block_expert: the expert of every BLOCK_M-row block
 kernel 1 (gate-up):  act[pair]  = silu(x[tok] @ Wg[e]^T) * (x[tok] @ Wu[e]^T)   [P, I]
 kernel 2 (down):     y[pair]    = (act[pair] @ W2[e]^T) * topk_weight[pair]       [P, H]
 combine:             out[t]     = sum_j y[t * k + j]                              [T, H]
```

``P = T * k`` (token, slot) pairs; ``tok = pair // k``.  Each program owns one block of
BLOCK_M pairs of a single expert and one BLOCK_N tile of the output features, so an
expert's weight tile is read once per block of its tokens -- at batch 1 the kernels read
each routed expert's weights once, the weight-read floor.  SiLU-and-mul is fused into
kernel 1's epilogue (gate and up tiles accumulate side by side) and the routing weight
into kernel 2's.  Experts with no tokens own no blocks; blocks past the padded total
exit at once, so the grid depends only on ``T``, ``k`` and ``E`` (no host sync: the
padded total stays on the device).  Shapes (``H``, ``I``, ``k``) are compile-time
constants: fixed per model, and loop bounds the interpreter can run.  The oracle is
``layers/fused_moe/torch_ref.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [max_padded] int32, block_expert [max_padded // block_m] int32,
    num_padded [1] int32)``; vectorised torch, no host sync.  ``max_padded`` bounds the
    padded length: ``P + min(P, E) * (block_m - 1)`` rounded up to ``block_m``."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    # scatter_add, not bincount: bincount reads the max id on the host (a sync, and no
    # CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat.index_select(0, order)
    rank = torch.arange(p, device=flat.device) - start.index_select(0, expert_of_sorted)
    dest = padded_start.index_select(0, expert_of_sorted) + rank
    max_padded = triton.cdiv(p + min(p, num_experts) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), p, dtype=torch.int32, device=flat.device)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                    num_pairs, top_k: tl.constexpr, hidden: tl.constexpr,
                    inter: tl.constexpr, stride_xt, stride_we, stride_wn, stride_ap,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + ks) < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (inter + cols[None, :]).to(tl.int64) * stride_wn
                     + (k0 + ks)[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * stride_ap + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
                 num_padded_ptr, num_pairs, hidden: tl.constexpr, inter: tl.constexpr,
                 stride_ap, stride_we, stride_wn, stride_op,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + ks) < inter
        a = tl.load(act_ptr + rows[:, None] * stride_ap + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    scale = tl.load(weights_ptr + rows, mask=valid, other=0.0)
    acc = acc * scale[:, None]
    tl.store(out_ptr + rows[:, None] * stride_op + cols[None, :], acc,
             mask=valid[:, None] & col_ok[None, :])


def _block_sizes(num_pairs: int, hidden: int, inter: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M tiles for decode-sized batches (few tokens
    per expert: less padding), larger ones when experts get many tokens."""
    block_m = 16 if num_pairs <= 512 else 64
    block_n = 64 if min(hidden, inter) >= 64 else 32
    return block_m, block_n, 64 if min(hidden, inter) >= 64 else 32


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``torch_ref.fused_experts_ref``: ``x [T, H]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, ``topk_weights/ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype."""
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    assert w13.stride(2) == 1 and w2.stride(2) == 1
    bm, bn, bk = _block_sizes(p, hidden, inter)
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, bm)
    n_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, bn))](
        x, w13, act, sorted_ids, block_expert, num_padded, p, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision)
    out = torch.empty(p, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(n_blocks, triton.cdiv(hidden, bn))](
        act, w2, out, weights, sorted_ids, block_expert, num_padded, p, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision)
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
