"""Batched multi-LoRA: each token row's ``y += (x A[slot]^T) Bt[slot]``, where every row
carries its own adapter slot (-1: none), so one step mixes adapters and base-model rows.

Two forms here (steps of many rows take the masked split-K form of
``kernels/lora_masked.py``, or cuBLAS: ``worker/lora/layers.lora_path``):

* :func:`lora_shrink` + the expand in the base GEMV's epilogue -- where the layer runs
  as the batch-1 GEMV (``kernels/gemv.py``, ``gemv_rope.py``): a Llama-3-8B step has
  128 target projections, so launches are the cost; the shrink is one split-K launch
  (or part of the RMSNorm's before qkv / gate_up: ``kernels/lora_norm.py``) and the
  expand costs no launch.  See the section below.
* :func:`lora_fused` -- shrink and expand in **one launch**, one program per row and
  block of outputs: up to a few rows on other base kernels (``worker/lora/layers.lora_path``);
  it can read its input as ``silu(gate) * up`` or return the fp32 delta.

Both read slot indices and weights from device buffers (no host sync) and launch fixed
grids for a row count, so CUDA graphs capture them.  Sums are fp32; the result is added
to ``y`` in fp32 and rounded once, and rows without an adapter are left bit-for-bit.
Oracle: ``worker/lora/layers.lora_ref``.  ``K``, ``R`` (and the shard count) are compile-time
constants: a layer's shapes, a handful per model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import GemvLoRA, _load_x
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait

# -- one launch: shrink and expand fused ------------------------------------------------
#
# Program (t, j) owns token row t and output features [j*BLOCK_N, (j+1)*BLOCK_N).  The
# stacked weights of a fused layer (``worker/lora/layers.py``) hold shard i's rank rows at
# [i*R, (i+1)*R) of A and Bt, and B is block-diagonal: an output feature of shard i
# reads only shard i's R shrink values.  BLOCK_N divides the shard bounds, so a block
# lies in one shard and its program computes that shard's shrink only (R rows of A over
# K: 128 KB at K = 4096, rank 16, from L2 after the first program of the slot), then
# expands it for its block.  The shrink is recomputed by every block of a shard --
# cheap at one row, which is what this form is for; steps with many rows take
# ``kernels/lora_masked.py``.  At one row there are few programs (< 1 per SM), so nothing hides
# one program's latency: the block's Bt tile and the first A tile are fetched before
# the PDL wait (weights: kernels/pdl.py), and the K loop is unrolled over wide tiles
# (few dependent round trips).


@triton.jit
def _fused_kernel(x_ptr, slots_ptr, a_ptr, bt_ptr, y_ptr, N, B1, B2,
                  stride_x, stride_y, stride_as, stride_bs,
                  K: tl.constexpr, R: tl.constexpr, SILU_MUL: tl.constexpr,
                  STORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_trigger(USE_PDL)
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    # The slot map is step metadata (written by a host copy before the forward), so it
    # may be read before the PDL wait (kernels/pdl.py).
    slot = tl.load(slots_ptr + t)
    has = slot >= 0  # without an adapter every load is masked off: no memory traffic
    sl = tl.maximum(slot, 0).to(tl.int64)
    # The block's shard: [0, B1), [B1, B2) or [B2, N) (absent bounds are N).
    shard = (n0 >= B1).to(tl.int32) + (n0 >= B2).to(tl.int32)
    rows = shard * R + tl.arange(0, BLOCK_R)
    w_ok = (tl.arange(0, BLOCK_R) < R) & has
    a_rows = a_ptr + sl * stride_as + rows[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    b = tl.load(bt_ptr + sl * stride_bs + rows[:, None] * N + ns[None, :],
                mask=w_ok[:, None] & n_ok[None, :], other=0.0)
    a0 = tl.load(a_rows + rk[None, :], mask=w_ok[:, None] & (rk < K)[None, :], other=0.0)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    pdl_wait(USE_PDL)
    x0 = _load_x(x_row, rk, (rk < K) & has, K, SILU_MUL, True)
    s = tl.sum(a0.to(tl.float32) * x0[None, :], axis=1)
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):
        ks = k0 + rk
        k_ok = (ks < K) & has
        xk = _load_x(x_row, ks, k_ok, K, SILU_MUL, True)
        a = tl.load(a_rows + ks[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        s += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    acc = tl.sum(s[:, None] * b.to(tl.float32), axis=0)
    out = y_ptr + t.to(tl.int64) * stride_y + ns
    if STORE:  # the delta itself, fp32, every row (zeros without an adapter)
        tl.store(out, acc, mask=n_ok)
    else:  # added in fp32, rounded once; rows without an adapter stay bit-for-bit
        ok = n_ok & has
        y = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=ok)


def fused_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): about 64 programs per row (each program's cost is
    its shard's shrink, so more blocks only add L2 traffic) and a [R, 2048] shrink tile
    over 8 warps (2 steps at K = 4096, 7 at 14336).  Written without a GPU:
    ``benchmarks/lora_probe.py --sweep`` (in git history) timed the alternatives on one."""
    block_n = max(64, min(512, triton.next_power_of_2(max(n // 64, 1))))
    return block_n, min(2048, triton.next_power_of_2(k)), 8


def _block_n(block_n: int, bounds: tuple[int, ...]) -> int:
    """The largest power of two <= ``block_n`` dividing every shard bound (a block then
    lies in one shard)."""
    while any(b % block_n for b in bounds):
        block_n //= 2
    return block_n


def lora_fused(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor | None = None,
               silu_mul: bool = False,
               config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Each row's ``x[t] A[s]^T Bt[s]`` with ``s = slots[t]`` (-1: none), one launch.

    ``x [T, K]`` (``[T, 2K]`` = ``[gate | up]`` with ``silu_mul``: the input is
    ``silu(gate) * up``, rounded as ``kernels/activation.py`` rounds it), ``slots [T]``
    int32, ``a [L, S*R, K]`` and ``bt [L, S*R, N]`` contiguous (the layout of
    ``worker/lora/layers.LoRALinear``), ``shard_bounds``: the S shards' first output features
    after the first (``()`` for one shard, ``(q, q + kv)`` for q/k/v; at most 3 shards).
    ``bt`` must be block-diagonal over the shards (shard i's rank rows zero outside shard
    i's outputs, as ``LoRALinear.set_slot`` writes it): an output of shard i reads only
    shard i's rank rows, so entries outside the blocks are ignored, unlike in
    ``lora_ref`` (which uses them).
    With ``y`` ``[T, N]`` (contiguous rows) the delta is added into it in place (rows
    without an adapter untouched) and ``y`` returned; without, the fp32 delta ``[T, N]``
    is returned (zeros for rows without an adapter).  No host sync; fixed grid."""
    t = x.shape[0]
    n_slots, sr, k = a.shape
    n = bt.shape[2]
    n_shards = len(shard_bounds) + 1
    if n_shards > 3 or sr % n_shards or x.shape[1] != (2 * k if silu_mul else k) \
            or x.stride(1) != 1:
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
    block_n = _block_n(block_n, shard_bounds)
    _fused_kernel[(t, triton.cdiv(n, block_n))](
        x, slots, a, bt, out, n, bounds[0], bounds[1], x.stride(0), out.stride(0),
        a.stride(0), bt.stride(0), K=k, R=r, SILU_MUL=silu_mul, STORE=store,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=triton.next_power_of_2(r),
        num_warps=warps, **pdl_launch_args(x.device))
    return out


# -- batch 1: split-K shrink, expand in the base GEMV's epilogue -------------------------
#
# At one row the delta is ~1 MB of adapter reads per layer: the cost is launches and
# dependent round trips, not bytes.  So the expand has no launch of its own: the base
# GEMV's program for an output block (``kernels/gemv.py``, ``kernels/gemv_rope.py``)
# fetches its block's Bt tile with its first weight tile (before the PDL wait) and adds
# ``t @ Bt`` to its rounded output before storing.  The shrink ``t = x A^T`` is one
# launch over SPLIT K chunks x S shards: each program reads an [R, CHUNK] tile of A
# (fetched before the PDL wait: weights) and writes fp32 partials ``[SPLIT, S*R]``; every
# GEMV program sums the SPLIT partials of its shard in a fixed order in its epilogue
# (1 KB from L2).  No shrink is recomputed, no atomics: two launches' worth of
# deterministic fp32 sums per projection, one of them the base GEMV's own.


@triton.jit
def _shrink_kernel(x_ptr, slots_ptr, a_ptr, t_ptr, stride_as, K: tl.constexpr,
                   R: tl.constexpr, SR: tl.constexpr, SILU_MUL: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_trigger(USE_PDL)
    j = tl.program_id(0)  # K chunk
    rows = tl.program_id(1) * R + tl.arange(0, BLOCK_R)  # this shard's rank rows
    r_ok = tl.arange(0, BLOCK_R) < R
    slot = tl.load(slots_ptr)  # step metadata: readable before the PDL wait
    has = slot >= 0  # without an adapter the loads are masked off and zeros stored
    ks = j * CHUNK + tl.arange(0, CHUNK)
    k_ok = (ks < K) & has
    a = tl.load(a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + rows[:, None] * K
                + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x = _load_x(x_ptr, ks, k_ok, K, SILU_MUL, True)
    tl.store(t_ptr + j * SR + rows, tl.sum(a.to(tl.float32) * x[None, :], axis=1),
             mask=r_ok)


def shrink_config(k: int) -> tuple[int, int]:
    """(CHUNK, num_warps): about 16 K chunks (K = 4096: 16 of 256; 14336: 14 of 1024,
    padded to 16 programs),
    so the GEMV epilogue sums <= 16 partials per rank row, and a tile of at most
    [16, 1024] bf16 per program (64 values per thread at 8 warps)."""
    chunk = max(64, triton.next_power_of_2(triton.cdiv(k, 16)))
    return chunk, 8 if chunk >= 1024 else 4


def lora_shrink(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                shard_bounds: tuple[int, ...], silu_mul: bool = False) -> GemvLoRA:
    """One launch: the split-K shrink of one row ``x [1, K]`` (``[1, 2K]`` = ``[gate |
    up]`` read as ``silu(gate) * up`` with ``silu_mul``) by its slot's ``a [L, S*R, K]``;
    returns the :class:`GemvLoRA` a batch-1 GEMV adds in its epilogue
    (``kernels/gemv.gemv(..., lora=)``, ``gemv_rope.gemv_qkv_rope(..., lora=)``).  No
    host sync; fixed grid."""
    n_slots, sr, k = a.shape
    n = bt.shape[2]
    n_shards = len(shard_bounds) + 1
    if x.shape != (1, 2 * k if silu_mul else k) or not x.is_contiguous() \
            or n_shards > 3 or sr % n_shards:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} / a {tuple(a.shape)} / "
                         f"{n_shards} shards do not fit")
    assert a.is_contiguous() and bt.is_contiguous() and bt.shape[1] == sr
    r = sr // n_shards
    chunk, warps = shrink_config(k)
    # A power of two (the epilogue's arange); chunks past K store zeros.
    split = triton.next_power_of_2(triton.cdiv(k, chunk))
    partials = torch.empty(split, sr, dtype=torch.float32, device=x.device)
    _shrink_kernel[(split, n_shards)](
        x, slots, a, partials, a.stride(0), K=k, R=r, SR=sr, SILU_MUL=silu_mul,
        CHUNK=chunk, BLOCK_R=triton.next_power_of_2(r), num_warps=warps,
        **pdl_launch_args(x.device))
    bounds = tuple(shard_bounds) + (n,) * (2 - len(shard_bounds))
    return GemvLoRA(partials, bt, slots, r, (bounds[0], bounds[1]))
