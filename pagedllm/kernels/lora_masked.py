"""Multi-LoRA for steps of many rows in two launches per projection: one Triton kernel
for the shrink with the per-row slot mask (:func:`lora_masked_shrink`), then ONE cuBLAS
``y.addmm_(t, Bt_all)`` (beta = 1, in place) for the expand over every slot.

```
 t [M, L*SR]:  row m holds x[m] A[slot_m]^T in its slot's SR columns, zeros elsewhere
 y += t @ Bt_all            Bt_all = bt.reshape(L*SR, N)  (the scale is folded in Bt)
```

The dense cuBLAS form (``worker/lora/layers.lora_dense_``) computes the same ``t`` in ~3
launches (GEMM over all slots, the mask's compare, the multiply); at a few hundred rows
those launches, not FLOPs, are the cost.  Here the mask is applied in the shrink's
epilogue, and the shrink is split over K so that a step of 16-256 rows still spreads
the A reads (up to 3.7 MB per projection at the 8B shape) over ~128 programs.

Split K without a second launch and deterministically: program (i, j, s) writes its
fp32 partial of tile (i, j) to a workspace (only the entries the mask keeps), then
increments the tile's counter; the last of the SPLIT programs to arrive sums the SPLIT
partials in split order (fixed: the result does not depend on arrival order), reading
only the kept entries (each row's slot columns in the tile, gathered), rounds once to
``t``'s dtype, writes them, and resets the counter to 0 for the next launch (so CUDA
graph replays find it zeroed); split 0 writes the tile's masked-off zeros.  Ordering: a
CTA barrier before the counter's acq_rel atomic releases every thread's partial stores
(PTX release is cumulative, as in CUTLASS's semaphore); the last program re-reads the
partials bypassing L1 (``.cg``).  Tiles where no row has a slot among the tile's
columns skip the K loop and store zeros (prefill chunks of one request: most tiles).

The counters are a persistent int32 buffer (``worker/lora/layers.LoRAMapping.counters``),
zero between launches; launches using it must not overlap (one stream).  Sums are fp32;
``t`` is rounded once to the weights' dtype (as cuBLAS's shrink output is in the dense
form), then cuBLAS accumulates ``y + t Bt`` in fp32 and rounds once.  Rows without an
adapter have ``t = 0`` and get ``y + 0``: unchanged.  Oracle: ``worker/lora/layers.lora_ref``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 models (no tf32), and bf16 in the interpreter (numpy has no bf16 dot)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


def _ieee(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (os.environ.get("TRITON_INTERPRET", "0") == "1")


# Programs a launch aims at (an H200 has 132 SMs) and the most K splits of a tile.
TARGET_PROGRAMS = 128
MAX_SPLIT = 16  # a multiple of 4 (the fixup's unrolled loop)
MIN_CHUNK = 256
# Counters a launch with SPLIT > 1 may use (one per tile; such launches have fewer
# tiles than TARGET_PROGRAMS).
N_COUNTERS = 1024
BLOCK_K = 64


@triton.jit
def _masked_shrink_kernel(x_ptr, slots_ptr, a_ptr, t_ptr, ws_ptr, cnt_ptr, M, LSR,
                          stride_x, stride_t, stride_ws, SPLIT, K: tl.constexpr,
                          CHUNK: tl.constexpr, SR: tl.constexpr, SR_P2: tl.constexpr,
                          BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          IEEE: tl.constexpr, MAX_SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < LSR
    slot = tl.load(slots_ptr + rm, mask=m_ok, other=-1)
    # Column c belongs to slot c // SR; the tile's columns span slots [lo, hi].
    lo = (pid_n * BLOCK_N) // SR
    hi = (tl.minimum(pid_n * BLOCK_N + BLOCK_N, LSR) - 1) // SR
    live = tl.sum(((slot >= lo) & (slot <= hi)).to(tl.int32), axis=0) > 0
    keep = (slot[:, None] == (rn // SR)[None, :]) & m_ok[:, None] & n_ok[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    t_ptrs = t_ptr + rm[:, None].to(tl.int64) * stride_t + rn[None, :]
    if live:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
        a_cols = a_ptr + rn[None, :].to(tl.int64) * K
        for k0 in range(0, CHUNK, BLOCK_K):
            ks = pid_k * CHUNK + k0 + rk
            k_ok = ks < K
            xt = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            at = tl.load(a_cols + ks[:, None], mask=n_ok[None, :] & k_ok[:, None],
                         other=0.0)  # A^T tile [BLOCK_K, BLOCK_N]
            acc = _dot(xt, at.to(xt.dtype), acc, IEEE)
        if SPLIT == 1:
            tl.store(t_ptrs, tl.where(keep, acc, 0.0).to(t_ptr.dtype.element_ty),
                     mask=out_ok)
        else:
            ws = ws_ptr + rm[:, None].to(tl.int64) * LSR + rn[None, :]
            tl.store(ws + pid_k * stride_ws, acc, mask=keep)
            if pid_k == 0:  # the entries the mask drops; the last program writes the rest
                tl.store(t_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=t_ptr.dtype.element_ty),
                         mask=out_ok & ~keep)
            tl.debug_barrier()  # every thread's partial stored before the release
            tile = pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:  # the last of the tile: sum in split order
                # Only the kept entries, gathered: row m's columns slot_m*SR + j inside
                # this block ([BLOCK_M, SR_P2], not the mostly-masked [BLOCK_M, BLOCK_N]).
                rj = tl.arange(0, SR_P2)
                n0 = pid_n * BLOCK_N
                cols = tl.maximum(slot, 0)[:, None] * SR + rj[None, :]
                g_ok = ((slot >= 0) & m_ok)[:, None] & (rj < SR)[None, :] \
                    & (cols >= n0) & (cols < n0 + BLOCK_N) & (cols < LSR)
                gp = ws_ptr + rm[:, None].to(tl.int64) * LSR + cols
                total = tl.zeros((BLOCK_M, SR_P2), dtype=tl.float32)
                # Unrolled, four splits' loads at a time in flight (one L2 round trip,
                # not four), added in split order; splits past SPLIT load nothing and
                # add exact zeros.
                for s0 in tl.static_range(0, MAX_SPLIT, 4):
                    p0 = tl.load(gp + s0 * stride_ws, mask=g_ok & (s0 < SPLIT), other=0.0,
                                 cache_modifier=".cg")
                    p1 = tl.load(gp + (s0 + 1) * stride_ws, mask=g_ok & (s0 + 1 < SPLIT),
                                 other=0.0, cache_modifier=".cg")
                    p2 = tl.load(gp + (s0 + 2) * stride_ws, mask=g_ok & (s0 + 2 < SPLIT),
                                 other=0.0, cache_modifier=".cg")
                    p3 = tl.load(gp + (s0 + 3) * stride_ws, mask=g_ok & (s0 + 3 < SPLIT),
                                 other=0.0, cache_modifier=".cg")
                    total += p0
                    total += p1
                    total += p2
                    total += p3
                tl.store(t_ptr + rm[:, None].to(tl.int64) * stride_t + cols,
                         total.to(t_ptr.dtype.element_ty), mask=g_ok)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    elif pid_k == 0:  # no row of the tile has a slot among its columns
        tl.store(t_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=t_ptr.dtype.element_ty),
                 mask=out_ok)


def masked_config(m: int, lsr: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, CHUNK, SPLIT) for ``m`` rows, ``lsr`` = L*S*R columns and ``k``
    inputs: tiles of [64, 128] (one Hopper wgmma m64n128; the FLOPs are negligible, so
    fewer rows do not take a smaller tile: the compiled variants are the CHUNKs; BLOCK_N
    128 covers all 8 slots of a rank-16 projection: x is read once per column block),
    then K split into power-of-two chunks of >= 256 so that tiles x SPLIT ~
    TARGET_PROGRAMS (SPLIT <= 16).  Written without a GPU: ``benchmarks/lora_probe.py``
    (in git history) timed it."""
    block_m = 64
    block_n = min(128, max(16, triton.next_power_of_2(lsr)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(lsr, block_n)
    want = max(1, min(MAX_SPLIT, triton.cdiv(TARGET_PROGRAMS, tiles)))
    # A power of two (a compile-time constant: a few variants per K).
    chunk = max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(k, want)))
    split = triton.cdiv(k, chunk)
    if split > 1 and tiles > N_COUNTERS:  # not reached with the constants above
        chunk, split = triton.next_power_of_2(k), 1
    return block_m, block_n, chunk, split


def new_counters(device: torch.device) -> torch.Tensor:
    """The persistent zeroed counter buffer :func:`lora_masked_shrink` needs."""
    return torch.zeros(N_COUNTERS, dtype=torch.int32, device=device)


def lora_masked_shrink(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                       counters: torch.Tensor, out_dtype: torch.dtype | None = None,
                       config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``t [M, L*SR]``: row m's ``x[m] A[slots[m]]^T`` in columns ``[s*SR, (s+1)*SR)`` of
    its slot ``s``, zeros elsewhere (and everywhere for ``slots[m] < 0``).  One launch.

    ``x [M, K]`` (copied if its columns are strided), ``slots [M]`` int32, ``a [L, SR,
    K]`` contiguous, ``counters``: :func:`new_counters` (zero; left zero).  ``t`` is in
    ``out_dtype`` (default ``x``'s), fp32 sums rounded once.  No host sync; the grid depends on
    ``M`` and the shapes only (graph-capturable)."""
    m, k = x.shape
    n_slots, sr, ka = a.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if ka != k:
        raise ValueError(f"lora_masked_shrink: x {tuple(x.shape)} / a {tuple(a.shape)}")
    assert a.is_contiguous() and slots.dtype == torch.int32
    lsr = n_slots * sr
    t = torch.empty(m, lsr, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return t
    block_m, block_n, chunk, split = config or masked_config(m, lsr, k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(lsr, block_n), split)
    assert split == 1 or grid[0] * grid[1] <= counters.numel() and split <= MAX_SPLIT
    ws = torch.empty(split, m, lsr, dtype=torch.float32, device=x.device) \
        if split > 1 else t
    _masked_shrink_kernel[grid](
        x, slots, a, t, ws, counters, m, lsr, x.stride(0), t.stride(0), m * lsr, split,
        K=k, CHUNK=chunk, SR=sr, SR_P2=triton.next_power_of_2(sr), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, IEEE=_ieee(x.dtype), MAX_SPLIT=MAX_SPLIT, num_warps=8)
    return t


def lora_masked_(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 counters: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y += lora_ref(x, slots, a, bt)`` in place, two launches: the masked shrink, then
    one cuBLAS GEMM accumulating into ``y`` (``addmm_``: beta = 1, no temporary, no
    elementwise kernel where ``y`` is contiguous).  ``bt [L, SR, N]`` contiguous, ``y
    [M, N]``; ``t`` is rounded to ``bt``'s dtype (cuBLAS needs one dtype)."""
    n_slots, sr, n = bt.shape
    t = lora_masked_shrink(x, slots, a, counters, out_dtype=bt.dtype)
    return y.addmm_(t, bt.reshape(n_slots * sr, n))
