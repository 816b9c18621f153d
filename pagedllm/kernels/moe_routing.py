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


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_lt,
                         NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                         TOP_K: tl.constexpr, K_P2: tl.constexpr,
                         RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    # Trigger at once: the experts' gate-up kernel launches now and waits on this one.
    pdl_start(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_P2)
    logits = tl.load(logits_ptr + tok * stride_lt + cols, mask=cols < NUM_EXPERTS,
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
