"""``FusedMoE``: a bank of SwiGLU experts behind a top-k router.

Weights, stacked over experts (vLLM's layout)::

  w13_weight [E_local, 2 * I_tp, H]   rows [gate_e | up_e]   (checkpoint w1/gate_proj, w3/up_proj)
  w2_weight  [E_local, H, I_tp]                              (checkpoint w2/down_proj)

Tensor parallelism shards every expert like a Llama MLP: ``w13`` by its intermediate rows
(column parallel, gate and up split separately), ``w2`` by its intermediate columns (row
parallel), and the combined output is all-reduced once.  Expert parallelism keeps whole
experts: rank r owns global experts ``[r * E_local, (r + 1) * E_local)``; the loader skips
the others (``expert_id`` outside the range) and ``forward`` will remap ids through
``expert_map`` once that lands -- today ``ep_size`` is 1.

How the experts are stored and multiplied is the layer's ``quant_method``
(``FusedMoEMethodBase``), as for linear layers: a quantisation config that knows MoE
offers ``get_moe_method(layer, prefix)``; one that does not is refused at build time
rather than silently running the experts unquantised.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedllm.layers.fused_moe.routing import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref
from pagedllm.layers.quantization.base import QuantizationConfig, set_weight_attrs


class FusedMoEMethodBase(ABC):
    """How a ``FusedMoE`` layer stores its experts and runs them."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register the layer's expert parameters (each with a ``weight_loader``)."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:  # noqa: B027
        """Repack after the checkpoint is loaded (default: nothing)."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` routed per ``topk_*`` ``[T, k]`` -> ``[T, H]`` (this rank's
        partial sum under tensor parallelism)."""

    def apply_routed(self, layer: FusedMoE, x: torch.Tensor,
                     router_logits: torch.Tensor) -> torch.Tensor | None:
        """Routing and experts in one call, where the method can fuse them (default:
        never): ``[T, H]``, or None to have the layer route and call :meth:`apply`."""
        return None


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Expert weights in the model dtype; the Triton fused kernel on CUDA, the torch
    reference elsewhere."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_per_partition: int, params_dtype: torch.dtype) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_per_partition,
                                       hidden_size, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_per_partition,
                                      dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        for p in (w13, w2):
            set_weight_attrs(p, {"weight_loader": layer.weight_loader})

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or layer.use_triton:
            from pagedllm.kernels.fused_moe import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                 topk_ids)
        return fused_experts_ref(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                 topk_ids)

    def apply_routed(self, layer: FusedMoE, x: torch.Tensor,
                     router_logits: torch.Tensor) -> torch.Tensor | None:
        """Decode batches on CUDA: the top-k inside the expert kernels
        (``fused_moe.fused_experts_routed``), one launch fewer per layer."""
        if not (x.is_cuda or layer.use_triton):
            return None
        from pagedllm.kernels.fused_moe import fused_experts_routed

        return fused_experts_routed(x, layer.w13_weight, layer.w2_weight, router_logits,
                                    layer.top_k, layer.renormalize)


class FusedMoE(nn.Module):
    """Router output -> experts -> combined ``[T, H]``.

    ``forward(x, router_logits)``: top-k selection (``select_experts``), then the
    quantisation method's grouped expert matmuls -- or both at once where the method's
    ``apply_routed`` fuses them (unquantised decode batches on CUDA).  ``prefix`` is the
    HF module name of the experts (``model.layers.3.mlp.experts``), as for linear layers.
    ``use_triton`` forces the Triton kernel on CPU tensors (tests, under
    ``TRITON_INTERPRET=1``).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, tp_size: int = 1,
                 tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by "
                             f"tp_size {tp_size}")
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} not divisible by ep_size {ep_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_local_experts = num_experts // ep_size
        self.expert_start = ep_rank * self.num_local_experts
        self.intermediate_per_partition = intermediate_size // tp_size
        self.prefix = prefix
        self.use_triton = False
        method: FusedMoEMethodBase | None = None
        if quant_config is not None:
            get = getattr(quant_config, "get_moe_method", None)
            if get is None:
                raise ValueError(f"quantization {quant_config.describe()!r} does not "
                                 f"support MoE experts ({prefix})")
            method = get(self, prefix)
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_per_partition,
                                         torch.get_default_dtype())

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        """Copy one expert's checkpoint matrix: ``shard_id`` "w1" (gate, ``[I, H]``),
        "w3" (up) or "w2" (down, ``[H, I]``); this rank's slice of it."""
        hit = self.expert_shard(param.data, loaded, shard_id, expert_id)
        if hit is not None:
            hit[0].copy_(hit[1])

    def expert_shard(self, data: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                     expert_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(destination view of data [E_local, rows, cols], this rank's slice of
        loaded)`` for one expert matrix (see ``weight_loader``), or None when the expert
        is another expert-parallel rank's; ``ValueError`` on a shape mismatch.  Methods
        that transform the matrix on its way in (quantise at load) use it too."""
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return None  # another expert-parallel rank's expert
        i = self.intermediate_per_partition
        if shard_id in ("w1", "w3"):
            dst = data[local].narrow(0, 0 if shard_id == "w1" else i, i)
            dim = 0
        elif shard_id == "w2":
            dst, dim = data[local], 1
        else:
            raise ValueError(f"expert shard_id must be w1, w2 or w3, got {shard_id!r}")
        expect = list(dst.shape)
        expect[dim] *= self.tp_size
        if list(loaded.shape) != expect:
            raise ValueError(f"shape mismatch for expert {expert_id} {shard_id}: parameter "
                             f"{tuple(expect)} vs checkpoint {tuple(loaded.shape)}")
        return dst, loaded.narrow(dim, self.tp_rank * dst.shape[dim], dst.shape[dim])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply_routed(self, x, router_logits)
        if out is None:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
            out = self.quant_method.apply(self, x, weights, ids)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out


def expert_params_mapping(num_experts: int, gate: str = "gate_proj", down: str = "down_proj",
                          up: str = "up_proj") -> list[tuple[str, str, int, str]]:
    """``(parameter name part, checkpoint name part, expert id, shard id)`` for every
    expert matrix, e.g. ``("experts.w13_weight", "experts.0.gate_proj.weight", 0, "w1")``;
    Mixtral names its matrices ``w1``/``w2``/``w3``."""
    out = []
    for e in range(num_experts):
        for part, shard in ((gate, "w1"), (up, "w3"), (down, "w2")):
            param = "experts.w2_weight" if shard == "w2" else "experts.w13_weight"
            out.append((param, f"experts.{e}.{part}.weight", e, shard))
    return out
