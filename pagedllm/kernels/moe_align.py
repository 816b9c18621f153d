"""``moe_align``: (token, slot) pairs grouped by expert, each expert's run padded to a
multiple of ``BLOCK_M`` -- two Triton launches, no host sync, CUDA-graph capturable.

```
 topk_ids [T, k] (flat: pair p = t * k + j)
 kernel 1, one program per CHUNK pairs:  counts[c, e] = #pairs of chunk c routed to e
 kernel 2, one program per chunk:        total[e]  = sum_c counts[c, e]
                                         before[e] = sum_{c' < c} counts[c', e]
                                         padded_end = cumsum(ceil(total / BLOCK_M) * BLOCK_M)
                                         dest(p)   = padded_start[e] + before[e]
                                                     + #{earlier pairs of chunk c on e}
                                         sorted_ids[dest(p)] = p
                   program 0 also:       the padding slots of every run <- P ("no pair"),
                                         block_expert[b] = #{e : padded_end[e] <= b * BLOCK_M},
                                         num_padded = padded_end[E - 1]
```

Within an expert the pairs keep ascending order (deterministic: no atomics), which the
GEMMs do not need but tests and debugging like.  Sizes: the grid and every buffer depend
only on ``P = T * k``, ``E`` and ``BLOCK_M`` (host ints), never on the routing, so a
CUDA graph captured for a batch size replays for any routing.  All per-expert vectors
are ``E_P2 = next_pow2(E)`` wide (the columns past ``E`` count nothing); the one-hot
tiles are ``[CHUNK or SUB, E_P2]``, so ``CHUNK`` shrinks as ``E`` grows to keep them
register-sized.  Replaces ~15 torch ops (argsort, two cumsums, searchsorted, scatters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SUB = 64  # pairs ranked at once in kernel 2: a [SUB, SUB] comparison tile
_ONE_HOT_ELEMS = 32768  # CHUNK * E_P2 bound for kernel 1's one-hot tile


# Batch-dependent ints are not specialised (== 1, % 16): one compile per shape.
@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, E_P2: tl.constexpr,
                        CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    # Out-of-range lanes read expert E_P2, a column no one-hot tile has.
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2).to(tl.int32)
    cols = tl.arange(0, E_P2)
    hit = (e[:, None] == cols[None, :]).to(tl.int32)
    tl.store(counts_ptr + pid * E_P2 + cols, tl.sum(hit, axis=0))


# Batch-dependent ints are not specialised (== 1, % 16): one compile per shape.
@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks"])
def _align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr,
                          num_padded_ptr, num_pairs, num_chunks, num_blocks,
                          NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                          ROWS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, E_P2)
    total = tl.zeros((E_P2,), dtype=tl.int32)
    before = tl.zeros((E_P2,), dtype=tl.int32)
    # while, not range(): the interpreter cannot take runtime ints as range() bounds
    # (numpy 2 refuses int() of their shape-(1,) arrays); nothing here needs pipelining.
    r0 = pid * 0  # an int32 tensor: loop-carried values keep one type
    while r0 < num_chunks:
        rows = r0 + tl.arange(0, ROWS)
        c = tl.load(counts_ptr + rows[:, None] * E_P2 + cols[None, :],
                    mask=rows[:, None] < num_chunks, other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where(rows[:, None] < pid, c, 0), axis=0)
        r0 += ROWS
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # This chunk's pairs, SUB at a time; `cursor[e]` = where expert e's next pair goes.
    cursor = padded_start + before
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: j comes before i
    for s in range(0, CHUNK, SUB):
        offs = pid * CHUNK + s + lane
        ok = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=ok, other=E_P2).to(tl.int32)
        hit = e[:, None] == cols[None, :]
        base = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=ok)
        cursor += tl.sum(hit.to(tl.int32), axis=0)

    if pid == 0:
        real = cols < NUM_EXPERTS
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        # Padding: slots [padded_start + total, padded_end) of every run (< BLOCK_M each).
        j = tl.arange(0, BLOCK_M)
        pad = (padded_start + total)[:, None] + j[None, :]
        tl.store(sorted_ptr + pad, num_pairs.to(tl.int32),
                 mask=(pad < padded_end[:, None]) & real[:, None])
        # The expert of every block: how many runs end at or before the block's start.
        b0 = pid * 0
        while b0 < num_blocks:
            b = b0 + tl.arange(0, 64)
            done = (padded_end[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
            expert = tl.minimum(tl.sum(done.to(tl.int32), axis=1), NUM_EXPERTS - 1)
            tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)
            b0 += 64


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length, a multiple of ``block_m``: every expert that has
    pairs (at most ``min(P, E)``) pads by at most ``block_m - 1``."""
    return triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1),
                       block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` (any integer dtype) -> ``(sorted_ids [max_padded] int32,
    block_expert [max_padded // block_m] int32, num_padded [1] int32)``.

    ``sorted_ids[:num_padded]`` lists pair ids expert by expert (experts ascending, pairs
    ascending within one), each run padded with ``P`` to a multiple of ``block_m`` (a
    power of two); past ``num_padded`` the contents are unspecified (the GEMMs skip those
    blocks).  ``block_expert[b]`` is the expert of block ``b``; ``max_padded`` is
    :func:`max_padded_pairs`."""
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    dev = flat.device
    max_padded = max_padded_pairs(p, num_experts, block_m)
    num_blocks = max_padded // block_m
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(_SUB, min(1024, _ONE_HOT_ELEMS // e_p2))
    num_chunks = max(1, triton.cdiv(p, chunk))
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](flat, counts, p, E_P2=e_p2, CHUNK=chunk)
    _align_scatter_kernel[(num_chunks,)](
        flat, counts, sorted_ids, block_expert, num_padded, p, num_chunks, num_blocks,
        NUM_EXPERTS=num_experts, E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk, SUB=_SUB,
        ROWS=max(1, min(16, 4096 // e_p2)))
    return sorted_ids, block_expert, num_padded
