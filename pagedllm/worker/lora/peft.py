"""Loading a PEFT LoRA adapter's tensors (after ``adapter_files.check_adapter``).

PEFT computes ``y = W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``).  Our models fuse q/k/v and gate/up (``models/llama.py``), so a
``q_proj`` adapter becomes shard 0 of ``qkv_proj``: ``LoRAAdapter.modules`` maps the
*fused* module name to one ``LoRAWeights`` per shard (None where the adapter leaves a
shard alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.lora.adapter_files import (
    NUM_SHARDS,
    PACKED_MODULES,
    PEFT_PREFIX,
    adapter_error,
    check_adapter,
)
from pagedllm.lora.request import LoRARequest


@dataclass
class LoRAWeights:
    """One (unfused) module's adapter: ``lora_a [r, in]``, ``lora_b [out, r]`` (fp32 on
    the CPU, full size: tensor-parallel ranks take their slice when loading a slot)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded adapter: fused module name (``model.layers.0.self_attn.qkv_proj``) ->
    per-shard weights."""

    request: LoRARequest
    rank: int
    modules: dict[str, list[LoRAWeights | None]]


def load_adapter(req: LoRARequest, max_lora_rank: int, hf_config: Any) -> LoRAAdapter:
    """Validate and read ``req``'s adapter (fp32 on the CPU): the arrays
    ``check_adapter`` read and checked in full (dtypes, shapes, byte ranges, finite)."""
    info = check_adapter(req, max_lora_rank, hf_config)
    tensors = info.tensors
    modules: dict[str, list[LoRAWeights | None]] = {}
    for module in info.ranks:
        a = torch.from_numpy(tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"])
        b = torch.from_numpy(tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"])
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise adapter_error(req, f"{module!r} holds non-finite weights")
        leaf = module.rsplit(".", 1)[-1]
        fused, shard = PACKED_MODULES[leaf]
        key = module[:-len(leaf)] + fused
        modules.setdefault(key, [None] * NUM_SHARDS[fused])[shard] = LoRAWeights(
            a.contiguous(), b.contiguous(), info.scale)
    return LoRAAdapter(req, max(info.ranks.values()), modules)
