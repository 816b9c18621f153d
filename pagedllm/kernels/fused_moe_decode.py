"""Fused MoE for a few tokens (decode): no sort, no alignment, two launches.

```
 kernel 1, grid (P, I / BLOCK_N), one program per (pair, feature tile):
     e = topk_ids[pair] (or, routed: the expert ranked pair % k in the token's logits)
     act[pair, n] = silu(x[t] . Wg[e, n]) * (x[t] . Wu[e, n])    t = pair // k    [P, I]
 kernel 2, grid (T, H / BLOCK_N), one program per (token, feature tile):
     out[t, n] = sum_j topk_weights[t, j] * (act[t*k+j] . W2[ids[t, j], n])   [T, H]
     slot loop:  one [BLOCK_N, BLOCK_K] tile per (slot, K step), slot by slot
     all slots:  one [k, BLOCK_N, BLOCK_K] tile per K step (the whole row: one step)
```

At decode a MoE layer is a read of its routed experts' weights (``3 * H * I`` each):
with ``P = T * k`` pairs no larger than the number of experts, almost every pair has an
expert to itself, so GEMV programs that read the expert id straight from ``topk_ids``
move the same bytes as the sorted grouped GEMM without its ``moe_align`` launches, its
``BLOCK_M`` padding rows, or tensor-core tiles that are 1/16 full.  Pairs vary fastest
in the grid, so programs of pairs that share an expert run side by side and read the
same weight tile through L2.  The combine over the ``k`` slots is kernel 2's reduction,
with the routing weight applied to the activation on load: no ``[P, H]`` buffer, no sum,
no atomics (a fixed reduction tree: the same bits on every run).

Kernel 2 at batch 1 is where the time went: Qwen3-30B-A3B's down GEMV (``H`` 2048
outputs, rows of ``I`` 768) has few rows per program, so the slot loop is ``k * I /
BLOCK_K`` = 24 dependent round trips of one 16-byte load per thread (PTX: one
``ld.global.v4`` between ``bar.sync``s per step) -- latency-bound, ~8 KB in flight per
SM where ~25 KB is needed.  The all-slots kernel loads all ``k`` experts' rows at once
(every load of the program in flight together) and, when ``BLOCK_K`` covers the row,
before the PDL wait, so the down weights stream while kernel 1 finishes.

Like ``kernels/gemv.py``: each program owns ``BLOCK_N`` rows and walks K in ``BLOCK_K``
steps with an elementwise fp32 accumulator reduced once at the end; out-of-range rows
re-read the last row (unmasked, vectorised weight loads) and are not stored.  ``H``,
``I``, ``k`` are compile-time constants (fixed per model), so one compile per
``DecodeConfig`` serves every batch size.  Which path and config run depends only on
``T``, ``k`` and ``E`` (host ints): eager and CUDA-graph runs of a batch size agree.

Routed (:func:`fused_moe_decode_routed`): both kernels take the router logits instead of
``topk_ids`` / ``topk_weights``; kernel 1 ranks its token's experts
(``moe_routing.topk_ranks``: one comparison tile, no serial arg-max rounds on its
critical path), kernel 2 runs ``fused_topk``'s arg-max rounds before its wait.  Same
experts as the routing launch (ties to the lower id), weights within float32 rounding.

PDL (``kernels/pdl.py``): kernel 2 is launched while kernel 1's last programs run and
fetches weight tiles before it waits for ``act``.  It also reads ``topk_ids`` /
``topk_weights`` (or the router logits) before its wait, which is safe because kernel 1
triggers only after its own wait: kernel 2 cannot start before every program of kernel 1
is past that wait, i.e. before every kernel ahead of kernel 1 (the router that wrote
them) has completed.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fused_moe_configs import DecodeConfig, get_decode_config
from pagedllm.kernels.moe_routing import ROUTED_MAX_EXPERTS, topk_ranks, topk_softmax
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait


@triton.jit
def _load_tile(rows_ptr, ks, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:  # static: unmasked, vectorised loads
        return tl.load(rows_ptr + ks[None, :])
    return tl.load(rows_ptr + ks[None, :], mask=ks[None, :] < K, other=0.0)


@triton.jit
def _load_vec(ptr, ks, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:
        return tl.load(ptr + ks).to(tl.float32)
    return tl.load(ptr + ks, mask=ks < K, other=0.0).to(tl.float32)


@triton.jit
def _decode_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, logits_ptr, stride_xt,
                           stride_we, stride_wn, stride_ap, stride_lt,
                           TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                           E_P2: tl.constexpr, USE_PDL: tl.constexpr):
    # Wait, then trigger: kernel 2 launches only once every program here is past its
    # wait, so everything before this kernel (the router that wrote topk_ids) is done.
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = tl.minimum(rn, INTER - 1).to(tl.int64)
    if ROUTED:  # this pair's expert from the router logits (no routing launch)
        experts, rank = topk_ranks(logits_ptr + (pair // TOP_K).to(tl.int64) * stride_lt,
                                      NUM_EXPERTS, E_P2)
        expert = tl.sum(tl.where(rank == pair % TOP_K, experts, 0), axis=0).to(tl.int64)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt
    gate_rows = w_ptr + expert * stride_we + rn_safe[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + rk
        x = _load_vec(x_row, ks, HIDDEN, BLOCK_K)[None, :]
        acc_g += _load_tile(gate_rows, ks, HIDDEN, BLOCK_K).to(tl.float32) * x
        acc_u += _load_tile(up_rows, ks, HIDDEN, BLOCK_K).to(tl.float32) * x
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + pair.to(tl.int64) * stride_ap + rn,
             act.to(act_ptr.dtype.element_ty), mask=rn < INTER)


@triton.jit
def _decode_down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, stride_ap,
                        stride_we, stride_wn, stride_ot, TOP_K: tl.constexpr,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_trigger(USE_PDL)
    tok = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_off = tl.minimum(rn, HIDDEN - 1).to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    # Slot 0's first weight tile before the wait (see the module docstring).
    first = tok * TOP_K
    w_rows = w_ptr + tl.load(ids_ptr + first).to(tl.int64) * stride_we + rn_off
    w0 = _load_tile(w_rows, rk, INTER, BLOCK_K)
    pdl_wait(USE_PDL)
    a0 = _load_vec(act_ptr + first.to(tl.int64) * stride_ap, rk, INTER, BLOCK_K)
    acc = w0.to(tl.float32) * (a0 * tl.load(weights_ptr + first))[None, :]
    for j in tl.static_range(TOP_K):  # unrolled: slot 0 starts at its second tile
        pair = first + j
        scale = tl.load(weights_ptr + pair).to(tl.float32)
        w_rows = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we + rn_off
        a_row = act_ptr + pair.to(tl.int64) * stride_ap
        for k0 in range(BLOCK_K if j == 0 else 0, INTER, BLOCK_K):
            ks = k0 + rk
            a = _load_vec(a_row, ks, INTER, BLOCK_K) * scale
            acc += _load_tile(w_rows, ks, INTER, BLOCK_K).to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + rn, out.to(out_ptr.dtype.element_ty),
             mask=rn < HIDDEN)


@triton.jit
def _decode_down_slots_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, logits_ptr,
                              stride_ap, stride_we, stride_wn, stride_ot, stride_lt,
                              TOP_K: tl.constexpr, K_P2: tl.constexpr,
                              HIDDEN: tl.constexpr, INTER: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              ROUTED: tl.constexpr, RENORMALIZE: tl.constexpr,
                              NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                              USE_PDL: tl.constexpr):
    # Kernel 2 with all k slots in one [K_P2, BLOCK_N, BLOCK_K] tile per step: k times
    # the bytes in flight of the slot loop, and (BLOCK_K >= INTER) the whole weight read
    # issued before the PDL wait, overlapping kernel 1's tail.  The sum over slots and
    # columns is one fixed reduction tree: deterministic, no atomics.
    pdl_trigger(USE_PDL)
    tok = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_off = tl.minimum(rn, HIDDEN - 1).to(tl.int64) * stride_wn
    slots = tl.arange(0, K_P2)
    pairs = tok * TOP_K + tl.minimum(slots, TOP_K - 1)  # padding slots: weight 0 below
    if ROUTED:  # the token's routing again, before the wait (logits: see module doc)
        scale, ids = topk_softmax(logits_ptr + tok.to(tl.int64) * stride_lt, NUM_EXPERTS,
                                  E_P2, TOP_K, K_P2, RENORMALIZE)
    else:
        ids = tl.load(ids_ptr + pairs)
    w_rows = (w_ptr + ids.to(tl.int64)[:, None, None] * stride_we
              + rn_off[None, :, None])
    a_rows = act_ptr + pairs.to(tl.int64)[:, None] * stride_ap
    rk = tl.arange(0, BLOCK_K)
    live = (slots < TOP_K)[:, None, None]  # static all-true when TOP_K == K_P2
    w = _load_slots(w_rows, rk, live, TOP_K, K_P2, INTER, BLOCK_K)
    pdl_wait(USE_PDL)
    if not ROUTED:
        scale = tl.load(weights_ptr + pairs, mask=slots < TOP_K, other=0.0).to(tl.float32)
    a = _load_vec(a_rows, rk[None, :], INTER, BLOCK_K) * scale[:, None]
    acc = w.to(tl.float32) * a[:, None, :]
    if (INTER + BLOCK_K - 1) // BLOCK_K <= 8:  # unrolled: later steps' loads in flight
        for k0 in tl.static_range(BLOCK_K, INTER, BLOCK_K):  # none if BLOCK_K >= INTER
            ks = k0 + rk
            a = _load_vec(a_rows, ks[None, :], INTER, BLOCK_K) * scale[:, None]
            w = _load_slots(w_rows, ks, live, TOP_K, K_P2, INTER, BLOCK_K)
            acc += w.to(tl.float32) * a[:, None, :]
    else:  # long rows (Mixtral's I = 14336): a loop, not 28+ copies of the body
        for k0 in range(BLOCK_K, INTER, BLOCK_K):
            ks = k0 + rk
            a = _load_vec(a_rows, ks[None, :], INTER, BLOCK_K) * scale[:, None]
            w = _load_slots(w_rows, ks, live, TOP_K, K_P2, INTER, BLOCK_K)
            acc += w.to(tl.float32) * a[:, None, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + rn, out.to(out_ptr.dtype.element_ty),
             mask=rn < HIDDEN)


@triton.jit
def _load_slots(rows_ptr, ks, live, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[K_P2, BLOCK_N, BLOCK_K]`` weights; padding slots and columns past ``K``
    masked (no bytes read for them), unmasked when neither exists."""
    ptrs = rows_ptr + ks[None, None, :]
    if K % BLOCK_K == 0:
        if TOP_K == K_P2:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=live, other=0.0)
    return tl.load(ptrs, mask=live & (ks < K)[None, None, :], other=0.0)


def _block_k(k: int) -> int:
    """The largest power of two <= 512 that divides ``k`` (unmasked loads) when that is
    at least 64, else ``next_pow2(k)`` capped at 512 (masked)."""
    bk = 512
    while bk >= 64:
        if k % bk == 0:
            return bk
        bk //= 2
    return min(512, triton.next_power_of_2(k))


def decode_block_n(rows: int, programs_per_row: int) -> int:
    """8 rows per program (as ``kernels/gemv.py``), 4 when that would leave fewer than
    ~4 programs per SM of an H100/H200 (132 SMs): many small programs keep more bytes in
    flight than a few big ones."""
    return 8 if triton.cdiv(rows, 8) * programs_per_row >= 4 * 132 else 4


def default_decode_config(tokens: int, top_k: int, inter: int,
                          hidden: int) -> DecodeConfig:
    """The heuristic for shapes ``DECODE_CONFIGS`` does not list.  Gate-up:
    :func:`decode_block_n` rows per program, :func:`_block_k` columns, 4 warps.  Down:
    the all-slots kernel with 2 rows per program (8 warps) and a ``[k, 2, BLOCK_K]``
    tile of at most 16 KB a row (<= 128 bytes of weights a thread, no spills on sm_90):
    the whole row where it fits (Qwen3-30B-A3B: 8 x 1024 padded bf16), else in a few
    steps for four or more slots (DeepSeek-V2-Lite: 6 slots of 1408, two steps of 1024),
    where the slot loop is ``k * I / BLOCK_K`` dependent round trips of one 16-byte
    load a thread (an H100 profile, 2026-12-05: V2-Lite's down GEMV at 35% of its
    floor on the slot loop); the slot loop for one or two slots of long rows (Mixtral:
    2 slots of 14336-wide rows, already ~86% of its floor)."""
    gate_up = (decode_block_n(inter, tokens * top_k), _block_k(hidden), 4)
    k_p2, i_p2 = triton.next_power_of_2(top_k), triton.next_power_of_2(inter)
    block_k = min(i_p2, 16 * 1024 // (2 * k_p2))
    if block_k == i_p2 or k_p2 >= 4:
        return DecodeConfig(*gate_up, 2, block_k, 8, True)
    return DecodeConfig(*gate_up, decode_block_n(hidden, tokens), _block_k(inter), 4, False)


def fused_experts_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         config: DecodeConfig | None = None,
                         warmup: bool = False) -> torch.Tensor | None:
    """Same contract as ``kernels/fused_moe.fused_experts`` (``x [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights/ids [T, k]`` -> ``[T, H]`` in
    ``x``'s dtype), for any ``T``; worth it while ``T * k`` is at most about ``E``.
    ``config`` overrides ``fused_moe_configs.DECODE_CONFIGS`` /
    :func:`default_decode_config` (the sweep); ``warmup`` compiles both kernels for it
    without running them (returns None)."""
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.float().contiguous()
    return _launch(x, w13, w2, ids, weights, None, topk_ids.shape[1], False, config,
                   warmup)


def decode_config(tokens: int, top_k: int, w13: torch.Tensor,
                  w2: torch.Tensor) -> DecodeConfig:
    """``DECODE_CONFIGS``' entry for this bank and batch, else the heuristic."""
    e, inter, hidden = w13.shape[0], w2.shape[2], w2.shape[1]
    return (get_decode_config(tokens, e, inter, hidden)
            or default_decode_config(tokens, top_k, inter, hidden))


def can_route_in_kernel(router_logits: torch.Tensor, config: DecodeConfig) -> bool:
    """Whether :func:`fused_moe_decode_routed` serves these logits with this config:
    the all-slots down kernel, ``route_in_kernel``, at most ``ROUTED_MAX_EXPERTS``
    experts."""
    return (config.down_all_slots and config.route_in_kernel and router_logits.dim() == 2
            and router_logits.shape[1] <= ROUTED_MAX_EXPERTS)


def fused_moe_decode_routed(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            router_logits: torch.Tensor, top_k: int, renormalize: bool,
                            config: DecodeConfig | None = None,
                            warmup: bool = False) -> torch.Tensor | None:
    """Routing and experts in the decode path's two launches: ``select_experts``'
    softmax / top-k / renormalise is recomputed from ``router_logits [T, E]`` in the
    prologue of both kernels (``moe_routing.topk_ranks``: the same experts as
    ``fused_topk``, weights within float32 rounding) instead of a routing launch of
    its own.  Needs :func:`can_route_in_kernel`; ``x [T, H]`` -> ``[T, H]``."""
    cfg = config or decode_config(x.shape[0], top_k, w13, w2)
    if not can_route_in_kernel(router_logits, cfg):
        raise ValueError("in-kernel routing needs the all-slots down kernel and "
                         f"<= {ROUTED_MAX_EXPERTS} experts")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    return _launch(x, w13, w2, None, None, logits, top_k, renormalize, cfg, warmup)


def _launch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            ids: torch.Tensor | None, weights: torch.Tensor | None,
            logits: torch.Tensor | None, top_k: int, renormalize: bool,
            config: DecodeConfig | None, warmup: bool) -> torch.Tensor | None:
    """Both kernels; routed (``logits`` given) or from ``ids`` / ``weights`` (flat)."""
    t, hidden = x.shape
    inter = w2.shape[2]
    p = t * top_k
    cfg = config or decode_config(t, top_k, w13, w2)
    routed = logits is not None
    # Unused pointer arguments get a tensor that exists (never dereferenced).
    logits_arg = logits if routed else x
    ids_arg = ids if ids is not None else x
    weights_arg = weights if weights is not None else x
    stride_lt = logits.stride(0) if logits is not None else 0
    n_experts = logits.shape[1] if logits is not None else 1
    route = dict(ROUTED=routed, NUM_EXPERTS=n_experts,
                 E_P2=triton.next_power_of_2(n_experts))
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_launch_args(x.device)
    bn = cfg.gate_up_block_n
    grid = (p, triton.cdiv(inter, bn))
    (partial(_decode_gate_up_kernel.warmup, grid=grid) if warmup
     else _decode_gate_up_kernel[grid])(
        x, w13, ids_arg, act, logits_arg, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), stride_lt, TOP_K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_N=bn,
        BLOCK_K=cfg.gate_up_block_k, num_warps=cfg.gate_up_warps, **route, **pdl)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    bn = cfg.down_block_n
    grid = (t, triton.cdiv(hidden, bn))
    consts = dict(TOP_K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_N=bn,
                  BLOCK_K=cfg.down_block_k, num_warps=cfg.down_warps, **pdl)
    if cfg.down_all_slots:
        kernel = _decode_down_slots_kernel
        args = (act, w2, ids_arg, weights_arg, out, logits_arg, act.stride(0),
                w2.stride(0), w2.stride(1), out.stride(0), stride_lt)
        consts.update(route, K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize)
    else:
        kernel = _decode_down_kernel
        args = (act, w2, ids_arg, weights_arg, out, act.stride(0), w2.stride(0),
                w2.stride(1), out.stride(0))
    (partial(kernel.warmup, grid=grid) if warmup else kernel[grid])(*args, **consts)
    return None if warmup else out
