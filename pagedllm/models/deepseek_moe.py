"""DeepSeekMoE: the MoE block of DeepSeek-V2/V3 (and Kimi-K2, Moonlight), and its
checkpoint-name mapping.

```
 x ─► gate (float32 router, [E] logits) ─► grouped_topk ─► FusedMoE.forward_topk ─┐
  │        (a plain softmax top-k, V2-Lite's: FusedMoE.forward routes itself)      │
  │        (+ e_score_correction_bias, V3: selection only)   routed experts       │
  └─► shared_experts (dense SwiGLU, n_shared_experts * moe_intermediate_size) ───┴─► + ─► out
```

Routing follows transformers 5.x exactly (``layers/fused_moe/routing.GroupedTopK``):

* **V2** (``DeepseekV2Moe``): softmax scores; ``topk_method`` "greedy", or
  "group_limited_greedy" (``n_group`` groups ranked by their best score, the
  ``topk_group`` best kept); the weights times ``routed_scaling_factor``, never
  renormalised (transformers' V2 router ignores ``norm_topk_prob``).
* **V3** (``DeepseekV3MoE``, ``topk_method`` "noaux_tc"): sigmoid scores; the selection
  adds ``e_score_correction_bias``; groups ranked by the sum of their two best biased
  scores; the weights are the unbiased scores, renormalised per ``norm_topk_prob``, times
  ``routed_scaling_factor``.

The scaling factor multiplies the routing weights (where transformers applies it), not
the shared experts.  The router's weight (and V3's bias) are float32 whatever the model
dtype, as transformers keeps them (``_keep_in_fp32_modules_strict``); the routed and
shared experts take the model's ``quant_config`` under their HF module names.  Expert
parallelism needs nothing here: ``FusedMoE`` reads its ``ep`` group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.fused_moe.routing import GroupedTopK, grouped_topk
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.llama import LlamaMLP


def is_deepseek_v3_routing(config: Any) -> bool:
    """V3's router (sigmoid, correction bias, top-2-sum groups): a ``deepseek_v3``
    config, or any config whose ``topk_method`` is "noaux_tc" (the released V3 /
    Kimi-K2 / Moonlight ``config.json``)."""
    return (getattr(config, "topk_method", None) == "noaux_tc"
            or getattr(config, "model_type", "") in ("deepseek_v3", "kimi_k2"))


def deepseek_routing(config: Any) -> GroupedTopK:
    """The :class:`GroupedTopK` of a DeepSeek-V2/V3 config (see the module docstring)."""
    scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    n_group = int(getattr(config, "n_group", None) or 1)
    topk_group = int(getattr(config, "topk_group", None) or n_group)
    if is_deepseek_v3_routing(config):
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        return GroupedTopK(scoring_func=scoring, num_expert_group=n_group,
                           topk_group=topk_group, group_score="top2_sum",
                           renormalize=bool(getattr(config, "norm_topk_prob", True)),
                           routed_scaling_factor=scale)
    method = getattr(config, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {method!r} is not supported for DeepSeek-V2 "
                         f"(greedy, group_limited_greedy, noaux_tc)")
    grouped = method == "group_limited_greedy"
    return GroupedTopK(scoring_func=getattr(config, "scoring_func", None) or "softmax",
                       num_expert_group=n_group if grouped else 1,
                       topk_group=topk_group if grouped else 1, group_score="max",
                       renormalize=False, routed_scaling_factor=scale)


ROUTER_GEMV_CONFIG = (4, 512, 4)  # kernels/gemv.py (BLOCK_N, BLOCK_K, warps)


class DeepseekRouter(nn.Module):
    """``weight [E, H]`` float32 (and ``e_score_correction_bias [E]`` float32 with
    ``bias``): ``x [T, H]`` -> ``(topk_weights, topk_ids)`` by ``routing``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, routing: GroupedTopK,
                 bias: bool) -> None:
        super().__init__()
        self.top_k, self.routing = top_k, routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> the float32 router logits ``[T, E]``.  One row on CUDA: the
        GEMV (``kernels/gemv.py``) reads the bf16 row and the float32 weight in one
        launch; cuBLAS's float32 path was three (the cast, a dot, a reduction)."""
        if x.is_cuda and x.shape[0] == 1 and x.dtype != torch.float32 and x.is_contiguous():
            from pagedllm.kernels.gemv import gemv

            out = torch.empty(1, self.weight.shape[0], dtype=torch.float32, device=x.device)
            # 4 rows a program: 16 programs for 64 experts (the default 8 gives 8).
            return gemv(x, self.weight, out=out, config=ROUTER_GEMV_CONFIG)
        return F.linear(x.float(), self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(self.logits(x), self.top_k, self.routing,
                            self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """The MoE block of one DeepSeek decoder layer (``prefix``: ``model.layers.{i}.mlp``).

    ``forward(x [T, H]) -> [T, H]``: routed experts (weights already scaled) plus the
    shared experts (absent when ``n_shared_experts`` is 0 or None)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DeepSeekMoE supports hidden_act 'silu', got {act!r}")
        hidden, inter = int(config.hidden_size), int(config.moe_intermediate_size)
        num_experts, top_k = int(config.n_routed_experts), int(config.num_experts_per_tok)
        routing = deepseek_routing(config)
        self.gate = DeepseekRouter(hidden, num_experts, top_k, routing,
                                   bias=is_deepseek_v3_routing(config))
        # V2-Lite's router is a plain softmax top-k: the expert layer routes (one launch
        # on CUDA, or inside the decode kernels' prologue), not 3 torch ops.
        self.experts_route = routing.plain_softmax and not is_deepseek_v3_routing(config)
        self.experts = FusedMoE(num_experts, top_k, hidden, inter, routing.renormalize,
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts: LlamaMLP | None = None
        if shared:
            self.shared_experts = LlamaMLP(hidden, inter * shared, False, quant_config,
                                           f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts_route:
            out = self.experts(x, self.gate.logits(x))
        else:
            weights, ids = self.gate(x)
            out = self.experts.forward_topk(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


_EXPERT_SHARDS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
                  "down_proj": ("w2_weight", "w2")}
_SHARED_SHARDS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                  "down_proj": ("down_proj", None)}


def deepseek_moe_weight_target(name: str) -> tuple[str, tuple[Any, ...]] | None:
    """``(parameter name, weight_loader args)`` for a checkpoint tensor of a
    ``DeepseekMoE`` block, or None when ``name`` is not one (the model maps it).

    * ``{p}.experts.{e}.{gate,up,down}_proj.weight`` (released checkpoints, and what
      transformers 5.x ``save_pretrained`` writes) -> ``{p}.experts.w13_weight`` /
      ``w2_weight`` with ``(shard id, e)``; quantised suffixes (``weight_scale``,
      ``input_scale``) go to ``w13_weight_scale`` etc. as for Mixtral;
    * ``{p}.experts.gate_up_proj`` ``[E, 2I, H]`` / ``{p}.experts.down_proj`` ``[E, H, I]``
      (transformers' in-memory fused layout) -> the same parameters, whole banks;
    * ``{p}.shared_experts.{gate,up}_proj.*`` -> ``{p}.shared_experts.gate_up_proj.*``
      with shard 0 / 1; ``down_proj`` unchanged;
    * ``{p}.gate.weight`` / ``{p}.gate.e_score_correction_bias`` unchanged (no args).
    """
    if ".mlp.experts." in name:
        head, _, tail = name.partition(".mlp.experts.")
        if tail in ("gate_up_proj", "down_proj"):  # fused banks
            param, shard = ("w13_weight", "w13") if tail == "gate_up_proj" \
                else ("w2_weight", "w2")
            return f"{head}.mlp.experts.{param}", (shard, None)
        parts = tail.split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in _EXPERT_SHARDS:
            param, shard = _EXPERT_SHARDS[parts[1]]
            if parts[2] != "weight":
                param = param.removesuffix("_weight") + "_" + parts[2]
            return f"{head}.mlp.experts.{param}", (shard, int(parts[0]))
        return None
    if ".mlp.shared_experts." in name:
        head, _, tail = name.partition(".mlp.shared_experts.")
        proj, _, leaf = tail.partition(".")
        if proj in _SHARED_SHARDS:
            fused, shard = _SHARED_SHARDS[proj]
            target = f"{head}.mlp.shared_experts.{fused}.{leaf}"
            return target, (() if shard is None else (shard,))
        return None
    if ".mlp.gate." in name:
        return name, ()
    return None
