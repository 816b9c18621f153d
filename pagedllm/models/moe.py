"""The sparse MoE block the MoE decoders share, and their checkpoint-name mapping.

```
 x ─► gate (router, [E] logits) ─► FusedMoE (top-k experts, combined) ─┐
  └─► shared_expert (dense SwiGLU) * sigmoid(shared_expert_gate(x)) ───┴─► + ─► out
```

The shared expert (Qwen2-MoE) is optional.  The router and the shared-expert gate stay
unquantised, as in vLLM (checkpoints keep them in the model dtype); the experts and the
shared expert take the model's ``quant_config`` under their HF module names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.fused_moe.layer import expert_params_mapping
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 renormalize: bool, shared_intermediate: int = 0,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize,
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        self.shared_expert: LlamaMLP | None = None
        if shared_intermediate:
            self.shared_expert = LlamaMLP(hidden, shared_intermediate, False, quant_config,
                                          f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-graph decoder whose MLPs are (some or all) ``SparseMoeBlock``s.

    Subclasses give ``num_experts_of(config)`` and ``make_mlp``; expert matrices
    ``...experts.{e}.{gate,up,down}_proj.weight`` load into the stacked
    ``w13_weight``/``w2_weight`` with ``(shard id, expert id)``."""

    expert_names = ("gate_proj", "down_proj", "up_proj")

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, backend, quant_config)
        gate, down, up = self.expert_names
        self._expert_map = {ckpt: (param, (shard, e)) for param, ckpt, e, shard in
                            expert_params_mapping(self.num_experts_of(hf_config), gate,
                                                  down, up)}

    @staticmethod
    def num_experts_of(config: Any) -> int:
        return int(config.num_experts)

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """Expert tensors go to the stacked parameter of their suffix:
        ``experts.3.gate_proj.weight`` -> ``experts.w13_weight`` and, for quantised
        experts, ``experts.3.gate_proj.weight_scale`` -> ``experts.w13_weight_scale``
        (``input_scale`` likewise), with ``(shard id, expert id)``."""
        if ".experts." in name:
            head, _, tail = name.partition(".experts.")
            stem, _, leaf = tail.rpartition(".")
            hit = self._expert_map.get(f"experts.{stem}.weight")
            if hit is not None:
                param = hit[0] if leaf == "weight" else \
                    hit[0].removesuffix("_weight") + "_" + leaf
                return f"{head}.{param}", hit[1]
        return super().weight_target(name)
