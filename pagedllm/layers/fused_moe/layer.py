"""``FusedMoE``: a bank of SwiGLU experts behind a top-k router.

Weights, stacked over experts (vLLM's layout)::

  w13_weight [E_local, 2 * I_tp, H]   rows [gate_e | up_e]   (checkpoint w1/gate_proj, w3/up_proj)
  w2_weight  [E_local, H, I_tp]                              (checkpoint w2/down_proj)

Tensor parallelism shards every expert like a Llama MLP: ``w13`` by its intermediate rows
(column parallel, gate and up split separately), ``w2`` by its intermediate columns (row
parallel), and the combined output is all-reduced once.  Expert parallelism
(``enable_expert_parallel``: the parallel state's ``ep`` group, or ``ep_size`` given
outright) keeps whole experts: rank r owns global experts ``[r * E_local, (r + 1) *
E_local)``; the loader skips the others (``expert_id`` outside the range).  Tokens are
replicated over the group (it is the TP group), so each rank runs its own experts'
(token, expert) pairs -- the other pairs are dropped (``local_topk``) -- and the partial
sums are all-reduced over the group, the collective a row-parallel down projection
needs anyway::

    rank 0: experts 0..E/2-1   ─┐  out_r = sum over the pairs routed to rank r's experts
    rank 1: experts E/2..E-1   ─┴─► all_reduce(out_0 + out_1) = every pair's sum

When the EP group spans data-parallel engines (EP = DP x TP, ``ParallelState.dp``), the
engines' tokens differ, so the layer hands them to a dispatcher instead
(``dispatch.py``: all-gather + reduce-scatter, or all-to-all, by
``ParallelState.all2all_backend``), which returns this engine's full sums; an idle
engine joins with zero tokens (``dispatch.moe_dummy_pass``).

How the experts are stored and multiplied is the layer's ``quant_method``
(``FusedMoEMethodBase``), as for linear layers: a quantisation config that knows MoE
offers ``get_moe_method(layer, prefix)``; one that does not is refused at build time
rather than silently running the experts unquantised.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedllm.distributed.parallel_state import current_parallel_state
from pagedllm.layers.fused_moe.dispatch import MoEDispatcher, make_dispatcher
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
    ``TRITON_INTERPRET=1``).  ``forward_topk(x, topk_weights, topk_ids)`` runs the
    experts on a routing computed elsewhere (DeepSeek's grouped top-k,
    ``models/deepseek_moe.py``); ids are global expert ids either way.

    Parallelism: ``ep_size``/``ep_rank`` default to the parallel state's ``ep`` group
    (built with ``enable_expert_parallel``: whole experts per rank, no slicing), else
    ``tp_size``/``tp_rank`` to its ``tp`` group (every expert sliced).  Sizes given
    outright without a matching group (tests) make ``forward`` return this rank's partial
    sum unreduced.  An ``ep`` group spanning DP engines gives the layer a ``dispatcher``
    (``dispatch.py``) that ``forward`` and ``forward_topk`` go through; the fused
    routing path is not used then.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, tp_size: int | None = None,
                 tp_rank: int | None = None, ep_size: int | None = None,
                 ep_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        state = current_parallel_state()
        if ep_size is None:
            ep_size, ep_rank = state.ep.world_size, state.ep.rank_in_group
        ep_rank = ep_rank or 0
        if tp_size is None:  # expert parallelism replaces slicing the experts
            tp_size, tp_rank = (state.tp.world_size, state.tp.rank_in_group) \
                if ep_size == 1 else (1, 0)
        tp_rank = tp_rank or 0
        if intermediate_size % tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by "
                             f"tp_size {tp_size}")
        if num_experts % ep_size:
            raise ValueError(f"enable_expert_parallel: num_experts {num_experts} not "
                             f"divisible by the expert-parallel size {ep_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        # The model dtype the layer is built in: its activations' (an idle engine's dummy
        # pass needs it; quantised weights do not tell it).
        self.act_dtype = torch.get_default_dtype()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.tp_group = state.tp if state.tp.world_size == tp_size > 1 else None
        self.ep_group = state.ep if state.ep.world_size == ep_size > 1 else None
        self.ep_size, self.ep_rank = ep_size, ep_rank
        # EP across DP engines: their tokens differ, so they are dispatched, not reduced.
        self.dispatcher: MoEDispatcher | None = \
            make_dispatcher(state) if self.ep_group is not None else None
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
                      expert_id: int | None) -> None:
        """Copy one expert's checkpoint matrix: ``shard_id`` "w1" (gate, ``[I, H]``),
        "w3" (up) or "w2" (down, ``[H, I]``); this rank's slice of it.  ``expert_id``
        None: a whole bank in transformers' fused layout, ``shard_id`` "w13"
        (``gate_up_proj [E, 2I, H]``, gate rows first) or "w2" (``down_proj [E, H, I]``);
        only this rank's experts are read."""
        if expert_id is None:
            for e in range(self.expert_start, self.expert_start + self.num_local_experts):
                one = loaded.narrow(0, e, 1)[0]
                if shard_id == "w13":
                    half = one.shape[0] // 2
                    self.weight_loader(param, one[:half], "w1", e)
                    self.weight_loader(param, one[half:], "w3", e)
                else:
                    self.weight_loader(param, one, shard_id, e)
            return
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
        if self.ep_size == 1:  # (a dispatcher implies ep_size > 1)
            out = self.quant_method.apply_routed(self, x, router_logits)
            if out is not None:
                return self._reduce(out)
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_topk(x, weights, ids)

    def forward_topk(self, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` through the experts ``topk_ids [T, k]`` (global ids) weighted
        by ``topk_weights [T, k]`` -> ``[T, H]``, summed over ranks (this engine's
        tokens through every expert, with a dispatcher; ``T`` may be 0)."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, topk_weights, topk_ids)
        return self._reduce(self.partial_sum(x, topk_weights, topk_ids))

    def partial_sum(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's unreduced ``[T, H]``: its experts' pairs of the global
        ``topk_ids`` (every pair without expert parallelism; another rank's dropped,
        ``local_topk``, with it)."""
        if self.ep_size > 1:
            topk_weights, topk_ids = self.local_topk(
                topk_weights, topk_ids, skip_id=not (x.is_cuda or self.use_triton))
        return self.apply_local(x, topk_weights, topk_ids)

    def apply_local(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` through this rank's experts by local ids ``[0, E_local)`` (the
        quantisation method's grouped matmuls) -> ``[T, H]``."""
        return self.quant_method.apply(self, x, topk_weights, topk_ids)

    def local_topk(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   skip_id: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> this rank's local ids; another rank's pairs get weight 0 and
        id ``E_local`` (``skip_id``: the torch reference skips ids past its experts, so
        they cost nothing) or id 0 (the Triton kernels need an id in range; the zero
        weight drops the product)."""
        local = topk_ids - self.expert_start
        mine = (local >= 0) & (local < self.num_local_experts)
        other = self.num_local_experts if skip_id else 0
        return (torch.where(mine, topk_weights, torch.zeros_like(topk_weights)),
                torch.where(mine, local, torch.full_like(local, other)))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (TP-sliced or EP-split experts)."""
        group = self.ep_group or self.tp_group
        return out if group is None else group.all_reduce(out)


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
