"""Top-k routing: which experts each token goes to, and with what weight.

``softmax(router_logits)`` in float32, the ``top_k`` largest probabilities per token,
optionally renormalised to sum to one (Mixtral always; Qwen2-MoE / Qwen3-MoE per
``norm_topk_prob``) -- the same order of operations as transformers' routers, so the
chosen experts agree bit for bit in float32.  On CUDA the same steps run as one Triton
launch (``kernels/moe_routing.fused_topk``; weights within float32 rounding of these).

DeepSeek's router (``grouped_topk``, :class:`GroupedTopK`) adds sigmoid scoring, a
selection-only correction bias, grouped top-k and a scaling factor; it runs in torch on
every device.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's router (V2 and V3), the order of operations of transformers'
    ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``::

        scores  = softmax(logits) | sigmoid(logits)               float32 [T, E]
        choice  = scores (+ e_score_correction_bias, V3)          used to *select* only
        groups  = choice.view(T, G, E / G) -> max (V2) | sum of top-2 (V3)
        keep the topk_group best groups; others masked (0.0 without a bias, -inf with)
        ids     = top_k of the masked choice
        weights = scores[ids] (V3: unbiased) | masked choice[ids] (V2: the same values)
                  / (sum + 1e-20) if renormalize;  * routed_scaling_factor

    ``num_expert_group == 1`` skips the grouping (every group kept: a no-op).  The
    top-k calls use ``sorted=False`` as transformers does, so the ids come in the same
    order and a renormalised sum rounds the same.
    """

    scoring_func: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    num_expert_group: int = 1
    topk_group: int = 1
    group_score: str = "max"  # "max" (V2 group_limited_greedy) or "top2_sum" (V3)
    renormalize: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def plain_softmax(self) -> bool:
        """Whether these steps reduce to a plain softmax top-k (V2's greedy router: every
        group kept, not renormalised, unscaled), which ``select_experts`` -- and the
        expert layer's own routing, ``FusedMoE.forward`` -- computes."""
        return (self.scoring_func == "softmax" and self.topk_group == self.num_expert_group
                and not self.renormalize and self.routed_scaling_factor == 1.0)

    def __post_init__(self) -> None:
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got "
                             f"{self.scoring_func!r}")
        if self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"group_score must be 'max' or 'top2_sum', got "
                             f"{self.group_score!r}")
        if not 0 < self.topk_group <= self.num_expert_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.num_expert_group}], "
                             f"got {self.topk_group}")


def grouped_topk(router_logits: torch.Tensor, top_k: int, params: GroupedTopK,
                 correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k]
    int64)`` by :class:`GroupedTopK`'s steps; ``correction_bias [E]`` (V3's
    ``e_score_correction_bias``) shifts the selection, never the weights.  Ids are in
    no particular order (the expert kernels do not depend on it)."""
    t, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
    groups = params.num_expert_group
    if num_experts % groups:
        raise ValueError(f"n_group {groups} does not divide the {num_experts} experts")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if params.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if groups > 1:
        grouped = choice.view(t, groups, num_experts // groups)
        if params.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=params.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, groups, num_experts // groups)
        fill = 0.0 if correction_bias is None else float("-inf")
        choice = choice.masked_fill(~keep.reshape(t, num_experts).bool(), fill)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = (choice if correction_bias is None else scores).gather(1, ids)
    if params.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if params.routed_scaling_factor != 1.0:
        weights = weights * params.routed_scaling_factor
    return weights, ids
