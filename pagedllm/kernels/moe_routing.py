"""MoE routing in one launch: softmax over the router logits, the top-k experts, and the
optional renormalisation (``layers/fused_moe/routing.select_experts`` on the GPU).

One program per token holds the token's ``E`` logits (``E_P2 = next_pow2(E)`` lanes) and
picks the k largest by k rounds of arg-max (exact ties, which bf16 router logits can
have, go to the lower expert id; torch.topk leaves their order unspecified), so the experts
are chosen on the logits themselves -- the order softmax preserves -- and only the chosen
probabilities ``exp(l - max) / sum exp(l - max)`` are kept.  Replaces four torch
launches (softmax, topk, sum, divide) per MoE layer, which at decode cost more than the
experts' own launch gaps.  Outputs match ``select_experts``' contract: ``weights [T, k]``
float32 in descending order, ``ids [T, k]`` int64.  Launched with PDL
(``kernels/pdl.py``): it reads the logits only after its wait, and triggers first, so
the experts' first kernel is launched while this one runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, pdl_start

MAX_EXPERTS = 1024  # one program holds a token's logits in registers
# The decode kernels that route in their prologue (``fused_moe_decode``, routed) compare
# every expert with every other in [E, 32] tiles; checked for spills up to 128 experts.
ROUTED_MAX_EXPERTS = 128
RIVALS: tl.constexpr = tl.constexpr(32)


@triton.jit
def topk_ranks(row_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr):
    """One token's expert order without k serial arg-max rounds (for a kernel that
    needs one slot's expert on its critical path): ``(experts, rank)``, each
    ``[E_P2]``: the expert ids and each expert's place in the descending order of the
    logits (``rank == j``: slot j; ties to the lower id, as :func:`topk_softmax`;
    padding lanes rank last).  No softmax: the order is the logits' own."""
    cols = tl.arange(0, E_P2)
    logits = tl.load(row_ptr + cols, mask=cols < NUM_EXPERTS,
                     other=float("-inf")).to(tl.float32)
    # rank[e] = #experts ahead of e, over 32 rivals at a time (an [E_P2, 32] tile, not
    # [E_P2, E_P2]: registers); rivals reloaded from L1 rather than re-laid-out.
    rank = tl.zeros((E_P2,), dtype=tl.int32)
    for c0 in tl.static_range(0, E_P2, RIVALS):
        rc = c0 + tl.arange(0, RIVALS)
        rival = tl.load(row_ptr + rc, mask=rc < NUM_EXPERTS,
                        other=float("-inf")).to(tl.float32)[None, :]
        ahead = (rival > logits[:, None]) | ((rival == logits[:, None])
                                              & (rc[None, :] < cols[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    rank = tl.where(cols < NUM_EXPERTS, rank, E_P2)
    return cols, rank


@triton.jit
def topk_softmax(row_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                 TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's ``(weights [K_P2] float32, ids [K_P2] int32)`` from its logits row
    (slots >= k: weight 0, id 0): k rounds of arg-max, as the module docstring says."""
    cols = tl.arange(0, E_P2)
    logits = tl.load(row_ptr + cols, mask=cols < NUM_EXPERTS,
                     other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    denom = tl.sum(tl.exp(logits - top), axis=0)
    slots = tl.arange(0, K_P2)
    weights = tl.zeros((K_P2,), dtype=tl.float32)
    ids = tl.zeros((K_P2,), dtype=tl.int32)
    left = logits
    for j in tl.static_range(TOP_K):
        best, idx = tl.max(left, axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
        weights = tl.where(slots == j, tl.exp(best - top) / denom, weights)
        ids = tl.where(slots == j, idx, ids)
        left = tl.where(cols == idx, float("-inf"), left)
    if RENORMALIZE:  # slots past TOP_K hold 0
        weights = weights / tl.sum(weights, axis=0)
    return weights, ids


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_lt,
                         NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                         TOP_K: tl.constexpr, K_P2: tl.constexpr,
                         RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    # Trigger at once: the experts' gate-up kernel launches now and waits on this one.
    pdl_start(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    weights, ids = topk_softmax(logits_ptr + tok * stride_lt, NUM_EXPERTS, E_P2, TOP_K,
                                K_P2, RENORMALIZE)
    slots = tl.arange(0, K_P2)
    out = tok * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slots < TOP_K)


def fused_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` (``E <= MAX_EXPERTS``, any float dtype) ->
    ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``."""
    t, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](
            router_logits, weights, ids, router_logits.stride(0), NUM_EXPERTS=num_experts,
            E_P2=triton.next_power_of_2(num_experts), TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, num_warps=1,
            **pdl_launch_args(router_logits.device))
    return weights, ids
