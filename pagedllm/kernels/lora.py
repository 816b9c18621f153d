"""Batched multi-LoRA: shrink ``s = x A[slot]^T`` then expand ``y += s Bt[slot]``.

Every token row carries its own adapter slot (``slots[t]``, -1: none), so one launch
serves a batch mixing adapters and base-model rows (vLLM's punica "sgmv" idea).  Each
program owns one token row and a block of output features and reads its slot's weights;
those are small (``R`` rows per layer, a few hundred KB) and stay in L2 across the rows
that share an adapter, so rows need not be sorted by adapter.  A row without an adapter
loads nothing and writes zeros (shrink) or nothing (expand): no host sync, fixed grid, so the pair
can be captured in a CUDA graph.  The shrink accumulates and stores in fp32; the expand
adds in fp32 and rounds once into ``y``'s dtype.  Oracle: ``lora/layers.lora_ref``.
``K``/``N``/``R`` are compile-time constants: a layer's shapes, a handful per model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, slots_ptr, a_ptr, out_ptr, K: tl.constexpr, R: tl.constexpr,
                   stride_x, stride_as,
                   stride_ar, stride_o, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < R
    slot = tl.load(slots_ptr + t)
    # A row without an adapter loads nothing (all masked) and stores zeros; a mask, not
    # a branch, keeps the program uniform.
    has = slot >= 0
    base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K) & has
        x = tl.load(x_ptr + t * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(base + rs[:, None] * stride_ar + ks[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]
    tl.store(out_ptr + t * stride_o + rs, tl.sum(acc, axis=1), mask=r_ok)


@triton.jit
def _expand_kernel(s_ptr, slots_ptr, bt_ptr, y_ptr, N: tl.constexpr, R: tl.constexpr,
                   stride_s, stride_bs, stride_br,
                   stride_y, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    has = slot >= 0
    base = bt_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (ns < N) & has
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = (rs < R) & has
        s = tl.load(s_ptr + t * stride_s + rs, mask=r_ok, other=0.0)
        b = tl.load(base + rs[:, None] * stride_br + ns[None, :],
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc += s[:, None] * b
    # Rows without an adapter store nothing: y stays bit-for-bit the base output.
    y = tl.load(y_ptr + t * stride_y + ns, mask=n_ok, other=0.0).to(tl.float32)
    out = y + tl.sum(acc, axis=0)
    tl.store(y_ptr + t * stride_y + ns, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def lora_shrink(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x [T, K]``, ``slots [T]``, ``a [L, R, K]`` -> fp32 ``[T, R]`` (zero rows where
    ``slots < 0``)."""
    t, k = x.shape
    r = a.shape[1]
    x = x.contiguous()
    out = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    block_r = min(32, triton.next_power_of_2(r))
    grid = (t, triton.cdiv(r, block_r))
    _shrink_kernel[grid](x, slots, a, out, k, r, x.stride(0), a.stride(0), a.stride(1),
                         out.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    return out


def lora_expand(s: torch.Tensor, slots: torch.Tensor, bt: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
    """``y[t] += s[t] Bt[slots[t]]`` in place for rows with a slot; ``s [T, R]`` fp32,
    ``bt [L, R, N]``, ``y [T, N]`` contiguous.  Returns ``y``."""
    t, r = s.shape
    n = y.shape[1]
    if t == 0:
        return y
    assert y.is_contiguous(), "lora_expand writes y in place"
    block_n = min(128, triton.next_power_of_2(n))
    grid = (t, triton.cdiv(n, block_n))
    _expand_kernel[grid](s, slots, bt, y, n, r, s.stride(0), bt.stride(0), bt.stride(1),
                         y.stride(0), BLOCK_N=block_n,
                         BLOCK_R=min(16, triton.next_power_of_2(r)))
    return y
