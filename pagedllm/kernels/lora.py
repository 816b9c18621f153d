"""Batched multi-LoRA: shrink ``s = x A[slot]^T`` then expand ``y += s Bt[slot]``.

Two forms: :func:`lora_fused` does both in **one launch** (small steps, decode at batch
1 above all: a Llama-3-8B decode step has 128 target projections, so launches are the
cost), and the :func:`lora_shrink` / :func:`lora_expand` pair (two launches, the shrink
done once per row instead of once per row and block of outputs).

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

from pagedllm.kernels.gemv import _load_x
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait


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


# -- one launch: shrink and expand fused ------------------------------------------------
#
# Program (t, j) owns token row t and output features [j*BLOCK_N, (j+1)*BLOCK_N).  The
# stacked weights of a fused layer (``lora/layers.py``) hold shard i's rank rows at
# [i*R, (i+1)*R) of A and Bt, and B is block-diagonal: an output feature of shard i
# reads only shard i's R shrink values.  So a program computes the shrink of only the
# shard(s) its block overlaps (R rows of A over K: 128 KB at K = 4096, rank 16, from
# L2 after the first program of the slot), then expands it for its block.  The shrink is
# recomputed by every block of a shard -- cheap at one row, which is what this form is
# for; steps with many rows take the pair above or the dense path (``lora/layers.py``).


@triton.jit
def _fused_kernel(x_ptr, slots_ptr, a_ptr, bt_ptr, y_ptr, N, B1, B2,
                  stride_x, stride_y, stride_as, stride_bs,
                  K: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                  SILU_MUL: tl.constexpr, STORE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_trigger(USE_PDL)
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    # The slot map is step metadata (written by a host copy before the forward), so it
    # may be read before the PDL wait (kernels/pdl.py).
    slot = tl.load(slots_ptr + t)
    has = slot >= 0
    sl = tl.maximum(slot, 0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    rk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.static_range(S):
        # Shard i's output features are [lo, hi): [0, B1), [B1, B2), [B2, N).
        lo = 0 if i == 0 else (B1 if i == 1 else B2)
        hi = B1 if i == 0 else (B2 if i == 1 else N)
        # A row without an adapter, or a shard this block does not touch, loads nothing.
        if has & (n0 < hi) & (n0 + BLOCK_N > lo):
            rows = i * R + rr
            a_rows = a_ptr + sl * stride_as + rows[:, None] * K
            s = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                k_ok = ks < K
                xk = _load_x(x_row, ks, k_ok, K, SILU_MUL, True)
                a = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                            other=0.0)
                s += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            b = tl.load(bt_ptr + sl * stride_bs + rows[:, None] * N + ns[None, :],
                        mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.sum(s[:, None] * b.to(tl.float32), axis=0)
    out = y_ptr + t.to(tl.int64) * stride_y + ns
    if STORE:  # the delta itself, fp32, every row (zeros without an adapter)
        tl.store(out, acc, mask=n_ok)
    else:  # added in fp32, rounded once; rows without an adapter stay bit-for-bit
        ok = n_ok & has
        y = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=ok)


def fused_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): about 64 programs per row (each program's cost is
    its shard's shrink, so more blocks only add L2 traffic), a [R, 512] shrink tile.
    Written without a GPU: ``benchmarks/lora_probe.py`` sweeps it on one."""
    block_n = max(64, min(512, triton.next_power_of_2(max(n // 64, 1))))
    return block_n, min(512, triton.next_power_of_2(k)), 4


def lora_fused(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor | None = None,
               silu_mul: bool = False,
               config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Each row's ``x[t] A[s]^T Bt[s]`` with ``s = slots[t]`` (-1: none), one launch.

    ``x [T, K]`` (``[T, 2K]`` = ``[gate | up]`` with ``silu_mul``: the input is
    ``silu(gate) * up``, rounded as ``kernels/activation.py`` rounds it), ``slots [T]``
    int32, ``a [L, S*R, K]`` and ``bt [L, S*R, N]`` contiguous (the layout of
    ``lora/layers.LoRALinear``), ``shard_bounds``: the S shards' first output features
    after the first (``()`` for one shard, ``(q, q + kv)`` for q/k/v).  With ``y``
    ``[T, N]`` (contiguous rows) the delta is added into it in place (rows without an
    adapter untouched) and ``y`` returned; without, the fp32 delta ``[T, N]`` is returned
    (zeros for rows without an adapter).  No host sync; fixed grid."""
    t = x.shape[0]
    n_slots, sr, k = a.shape
    n = bt.shape[2]
    n_shards = len(shard_bounds) + 1
    if sr % n_shards or x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        raise ValueError(f"lora_fused: x {tuple(x.shape)} / a {tuple(a.shape)} / "
                         f"{n_shards} shards do not fit")
    assert a.is_contiguous() and bt.is_contiguous()
    store = y is None
    out = torch.empty(t, n, dtype=torch.float32, device=x.device) if store else y
    assert out.stride(1) == 1 and out.shape == (t, n)
    if t == 0:
        return out
    r = sr // n_shards
    bounds = list(shard_bounds) + [n] * (2 - len(shard_bounds))
    block_n, block_k, warps = config or fused_config(n, k)
    _fused_kernel[(t, triton.cdiv(n, block_n))](
        x, slots, a, bt, out, n, bounds[0], bounds[1], x.stride(0), out.stride(0),
        a.stride(0), bt.stride(0), K=k, R=r, S=n_shards, SILU_MUL=silu_mul, STORE=store,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=triton.next_power_of_2(r),
        num_warps=warps, **pdl_launch_args(x.device))
    return out
