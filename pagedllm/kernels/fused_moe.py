"""Fused mixture-of-experts on the GPU: a GEMV path for a few tokens, tokens sorted by
expert and two grouped GEMMs for the rest.

```
 T * k <= min(64, E) pairs  ->  kernels/fused_moe_decode.py: two GEMV launches that read
                                the expert ids straight from topk_ids (decode)
 otherwise (sorted path):
 topk_ids [T, k] ──moe_align──► sorted_ids: pair ids grouped by expert, each expert's run
   (kernels/moe_align.py,       padded to a multiple of BLOCK_M (pad = P, "no pair")
    two launches)               block_expert: the expert of every BLOCK_M-row block
 kernel 1 (gate-up):  act[pair]  = silu(x[tok] @ Wg[e]^T) * (x[tok] @ Wu[e]^T)   [P, I]
 kernel 2 (down):     y[pair]    = (act[pair] @ W2[e]^T) * topk_weight[pair]       [P, H]
 combine:             out[t]     = sum_j y[t * k + j]            (one torch.sum)  [T, H]
```

``P = T * k`` (token, slot) pairs; ``tok = pair // k``.  Each sorted-path program owns
one block of BLOCK_M pairs of a single expert and one BLOCK_N tile of the output
features, so an expert's weight tile is read once per block of its tokens.  SiLU-and-mul
is fused into kernel 1's epilogue (gate and up tiles accumulate side by side) and the
routing weight into kernel 2's.  Experts with no tokens own no blocks; blocks past the
padded total exit at once, so the grid depends only on ``T``, ``k`` and ``E`` (no host
sync: the padded total stays on the device) and the whole call is CUDA-graph capturable.
Programs are ordered in GROUP_M bands of blocks (as Triton's matmul tutorial does) so
that a band's activation rows stay in L2 while its weight tiles stream.  Tile sizes come
from ``kernels/fused_moe_configs.py`` per ``(E, I, H)`` and token count.  Shapes (``H``,
``I``, ``k``) are compile-time constants: fixed per model, and loop bounds the
interpreter can run.  The oracle is ``layers/fused_moe/torch_ref.py``.

FP8 experts (``W_FP8``, weight-only, ``layers/quantization/fp8_moe.py``): the weights are
e4m3 with a float32 scale per expert and output channel (``w13_scale [E, 2I]``,
``w2_scale [E, H]``).  Tiles load as e4m3 (half the bytes), convert to the activation
dtype in registers (exact: every e4m3 value is a bf16/fp16 value) and feed the same
``tl.dot``; since the scale belongs to an output column it multiplies the fp32
accumulator once after the K loop (before SiLU, before the routing weight).  The bf16
kernels compile unchanged (``W_FP8`` is a constexpr).  FP8 runs the sorted path at every
batch size: the decode GEMVs have no FP8 variant yet.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fused_moe_configs import Config, get_config
from pagedllm.kernels.fused_moe_decode import (
    can_route_in_kernel,
    decode_config,
    fused_experts_decode,
    fused_moe_decode_routed,
)
from pagedllm.kernels.moe_align import moe_align

__all__ = ["DECODE_MAX_PAIRS", "fused_experts", "fused_experts_routed", "moe_align",
           "use_decode_path"]

DECODE_MAX_PAIRS = 64  # the GEMV path's bound on T * k (and T * k <= E)
Path = Literal["auto", "decode", "sorted"]


def use_decode_path(num_pairs: int, num_experts: int) -> bool:
    """The GEMV path while pairs rarely share an expert (``P <= E``) and are few: each
    pair reads its own expert's weights, which is the floor when experts are distinct."""
    return num_pairs <= min(DECODE_MAX_PAIRS, num_experts)


@triton.jit
def _block_tile(num_blocks, n_tiles, GROUP_M: tl.constexpr):
    """(block, feature tile) of this program: GROUP_M blocks side by side per tile."""
    pid = tl.program_id(0)
    per_group = GROUP_M * n_tiles
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


# Batch-dependent ints are not specialised (== 1, % 16): one compile per shape.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _sorted_gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr,
                           num_padded_ptr, num_pairs, num_blocks, stride_xt, stride_we,
                           stride_wn, stride_ap, ws_ptr, TOP_K: tl.constexpr,
                           HIDDEN: tl.constexpr, INTER: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           PRECISION: tl.constexpr, W_FP8: tl.constexpr = False):
    pid_m, pid_n = _block_tile(num_blocks, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    # Padding rows read token 0 (unmasked loads) and are never stored.
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_safe = tl.minimum(cols, INTER - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + rk[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols_safe[None, :] * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = rk < HIDDEN - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if W_FP8:  # e4m3 -> the activation dtype in registers (exact for bf16/fp16/fp32)
            wg = wg.to(a.dtype)
            wu = wu.to(a.dtype)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_FP8:  # per-output-channel scales commute with the K sum: scale once, in fp32
        s_row = ws_ptr + expert * (2 * INTER) + cols_safe
        acc_g = acc_g * tl.load(s_row)[None, :]
        acc_u = acc_u * tl.load(s_row + INTER)[None, :]
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * stride_ap + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & (cols < INTER)[None, :])


# Batch-dependent ints are not specialised (== 1, % 16): one compile per shape.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _sorted_down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
                        num_padded_ptr, num_pairs, num_blocks, stride_ap, stride_we,
                        stride_wn, stride_op, ws_ptr, HIDDEN: tl.constexpr,
                        INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        PRECISION: tl.constexpr, W_FP8: tl.constexpr = False):
    pid_m, pid_n = _block_tile(num_blocks, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_safe = tl.minimum(cols, HIDDEN - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_ap + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols_safe[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk < INTER - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if W_FP8:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_FP8:
        acc = acc * tl.load(ws_ptr + expert * HIDDEN + cols_safe)[None, :]
    acc = acc * tl.load(weights_ptr + rows)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_op + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < HIDDEN)[None, :])


def fused_experts_sorted(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         config: Config | None = None,
                         warmup: bool = False, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The sorted grouped-GEMM path (``fused_experts``'s contract); ``config`` overrides
    the launch table and ``warmup`` compiles the two GEMMs for it without running them
    (returns None; the sweep compiles its candidates in parallel that way).
    ``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` (fp32, contiguous): the weights are
    float8_e4m3fn, dequantised per output channel (``W_FP8``, see the module doc)."""
    fp8 = _check_fp8_scales(w13, w2, w13_scale, w2_scale)
    t, hidden = x.shape
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    p = t * top_k
    if config is None:
        config = get_config(t, num_experts, inter, hidden, top_k)
        config = fp8_config(config) if fp8 else config
    bm, bn, bk, group_m, warps, stages = config
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, bm)
    n_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    half = max(16, bn // 2)  # gate and up columns per program (BLOCK_N of [gate | up])
    grid = (n_blocks * triton.cdiv(inter, half),)
    (partial(_sorted_gate_up_kernel.warmup, grid=grid) if warmup
     else _sorted_gate_up_kernel[grid])(
        x, w13, act, sorted_ids, block_expert, num_padded, p, n_blocks, x.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), w13_scale if fp8 else w13,
        TOP_K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_M=bm, BLOCK_N=half, BLOCK_K=bk,
        GROUP_M=group_m, PRECISION=precision, W_FP8=fp8, num_warps=warps,
        num_stages=stages)
    y = torch.empty(p, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.float().contiguous()
    grid = (n_blocks * triton.cdiv(hidden, bn),)
    (partial(_sorted_down_kernel.warmup, grid=grid) if warmup else _sorted_down_kernel[grid])(
        act, w2, y, weights, sorted_ids, block_expert, num_padded, p, n_blocks,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), w2_scale if fp8 else w2,
        HIDDEN=hidden, INTER=inter, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        PRECISION=precision, W_FP8=fp8, num_warps=warps, num_stages=stages)
    if warmup:
        return None
    # torch.sum accumulates bf16/fp16 in fp32 and rounds once: one launch.
    return y.view(t, top_k, hidden).sum(dim=1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  path: Path = "auto", w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``torch_ref.fused_experts_ref``: ``x [T, H]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, ``topk_weights/ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype.

    ``path``: ``"auto"`` picks by :func:`use_decode_path` (host ints only, never data);
    ``"decode"`` / ``"sorted"`` force one (tests, benchmarks).  With ``w13_scale`` /
    ``w2_scale`` (FP8 weights, ``layers/quantization/fp8_moe.py``) every batch size runs
    the sorted path: the decode GEMVs have no FP8 variant yet."""
    t = x.shape[0]
    if t == 0:
        return torch.empty_like(x)
    if path not in ("auto", "decode", "sorted"):
        raise ValueError(f"path must be auto, decode or sorted, got {path!r}")
    x = x if x.is_contiguous() else x.contiguous()
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights must be contiguous along their input dimension")
    if w13_scale is not None:
        if path == "decode":
            raise ValueError("path='decode' has no FP8 variant; use 'auto' or 'sorted'")
        return fused_experts_sorted(x, w13, w2, topk_weights, topk_ids,  # type: ignore
                                    w13_scale=w13_scale, w2_scale=w2_scale)
    if path == "decode" or (path == "auto"
                            and use_decode_path(t * topk_ids.shape[1], w13.shape[0])):
        return fused_experts_decode(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_sorted(x, w13, w2, topk_weights, topk_ids)


def fp8_config(config: Config) -> Config:
    """The launch table's entry adjusted for ``W_FP8``: the e4m3 -> bf16 conversion holds
    a converted copy of the weight tile in registers, so 4 warps on a 32x256 output tile
    spilled on sm_90 (``tests/kernels/test_fused_moe_fp8.py``); such tiles get 8 warps."""
    bm, bn, bk, group_m, warps, stages = config
    if bm * bn >= 8192 and warps < 8:
        warps = 8
    return bm, bn, bk, group_m, warps, stages


def _check_fp8_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None) -> bool:
    """Whether the call is FP8 (both scales given); ``ValueError`` on a half-given or
    mis-shaped pair (the kernels index the scales as contiguous ``[E, N]``)."""
    if w13_scale is None and w2_scale is None:
        return False
    if w13_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    for w, sc, name in ((w13, w13_scale, "w13"), (w2, w2_scale, "w2")):
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} must be float8_e4m3fn with a scale, got {w.dtype}")
        if (sc.dtype != torch.float32 or tuple(sc.shape) != tuple(w.shape[:2])
                or not sc.is_contiguous()):
            raise ValueError(f"{name}_scale must be contiguous float32 {tuple(w.shape[:2])}, "
                             f"got {sc.dtype} {tuple(sc.shape)}")
    return True


def fused_experts_routed(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> torch.Tensor | None:
    """Routing and experts in two launches (``FusedMoE.forward``'s decode steps): the
    decode path with the top-k recomputed from ``router_logits [T, E]`` inside its
    kernels (``fused_moe_decode.fused_moe_decode_routed``), so no routing launch and no
    ``topk_ids`` round trip.  None where that does not apply (sorted-path batches, more
    than ``ROUTED_MAX_EXPERTS`` experts, a slot-loop config, a bad ``top_k``): the caller
    then routes with ``select_experts`` and calls :func:`fused_experts`."""
    t = x.shape[0]
    num_experts = w13.shape[0]
    if (t == 0 or router_logits.shape != (t, num_experts) or not 0 < top_k <= num_experts
            or not use_decode_path(t * top_k, num_experts)
            or w13.stride(2) != 1 or w2.stride(2) != 1):
        return None
    cfg = decode_config(t, top_k, w13, w2)
    if not can_route_in_kernel(router_logits, cfg):
        return None
    x = x if x.is_contiguous() else x.contiguous()
    return fused_moe_decode_routed(x, w13, w2, router_logits, top_k, renormalize, cfg)
