"""Mixture-of-experts layer: routing, the expert weights and the grouped expert matmuls."""

from pagedllm.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase
from pagedllm.layers.fused_moe.routing import select_experts

__all__ = ["FusedMoE", "FusedMoEMethodBase", "select_experts"]
