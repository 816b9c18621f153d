"""Top-k routing: which experts each token goes to, and with what weight.

``softmax(router_logits)`` in float32, the ``top_k`` largest probabilities per token,
optionally renormalised to sum to one (Mixtral always; Qwen2-MoE / Qwen3-MoE per
``norm_topk_prob``) -- the same order of operations as transformers' routers, so the
chosen experts agree bit for bit in float32.  On CUDA the same steps run as one Triton
launch (``kernels/moe_routing.fused_topk``; weights within float32 rounding of these).
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``.

    Rows of ``topk_ids`` are in descending probability order (``torch.topk``); the
    expert kernels do not depend on that order."""
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"num_experts_per_tok must be in [1, {router_logits.shape[-1]}], "
                         f"got {top_k}")
    if router_logits.is_cuda and router_logits.dim() == 2:
        from pagedllm.kernels.moe_routing import MAX_EXPERTS, fused_topk

        if router_logits.shape[-1] <= MAX_EXPERTS:
            return fused_topk(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
