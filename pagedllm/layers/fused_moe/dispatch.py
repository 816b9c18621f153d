"""Token dispatch and combine for MoE layers whose expert-parallel group spans
data-parallel engines (EP size = DP x TP, ``distributed/parallel_state.py``).

Inside one engine the TP ranks hold the same tokens, so the TP-only expert parallelism
of ``FusedMoE`` needs no dispatch: each rank runs its experts' pairs and one all-reduce
combines them.  Across DP engines the tokens differ -- in number too, and an idle engine
has none but still owns experts that the other engines' tokens need -- so a layer must
move tokens to its experts' ranks and the results back.  Two ways, by
``ParallelState.all2all_backend`` (vLLM's names); both compute, for this engine's tokens,
the full sum over every expert, identical on the engine's TP ranks::

  allgather_reducescatter                    alltoall
  ───────────────────────                    ────────
  counts   all_gather over dp (1 int each)   each TP rank takes 1/tp of the engine's
  x, route all_gather over dp, padded to     tokens; per expert pair counts all_to_all
           the largest engine's count        over ep; each pair's row all_to_all to the
  every EP rank runs its experts on every    expert's rank; the rank runs its experts
           engine's tokens (local_topk)      (weight 1); results all_to_all back; the
  reduce_scatter over dp: own engine's rows  sender weights and sums its pairs; the TP
  all_reduce over tp (TP > 1)                ranks all_gather their shares (TP > 1)

**allgather_reducescatter** sends every token to every rank (``dp * T_max`` rows each)
and sums ``[dp * T_max, H]`` partial outputs: two small gathers (counts, routing) and
two big collectives (hidden states, partial sums), plus the TP all-reduce, whatever the
routing.  Its combine is the sum over the EP group ``{(d, t)}`` handed back
by engine: the reduce-scatter over the dp group (the ranks ``(*, t)``) sums over ``d``
and leaves each rank its engine's ``T_max`` rows, then the all-reduce over the engine's
TP group sums over ``t``.  Reduce-scatter first because it shrinks the tensor ``dp``-fold
before the second collective; the one other correct order (all-reduce over tp, then
reduce-scatter over dp) all-reduces the whole gathered tensor.  (A reduce-scatter over
the whole EP group into ``T_max / tp`` row slices, then an all-gather over tp, would move
less again, at the price of padding rows to a multiple of tp; not done.)

**alltoall** moves each (token, expert) pair's hidden row only to the rank owning that
expert, and each row once: the engine's TP ranks split its tokens (equal chunks of
``ceil(T / tp)``) so no pair is sent by two of them.  The pairs are sent sorted by global
expert id, so the per-expert counts alone (the first all-to-all) tell a receiver the
local expert of every row it gets; no ids travel.  The receiver runs the rows through its
``quant_method.apply`` with top-1 routing of weight 1; the routing weights never leave
the sender, which applies them when it sums a token's returning rows (in expert order,
as the single-rank reference adds them).

Both read token counts on the host (one device->host sync per layer: the sizes a
collective needs), so a layer with a dispatcher cannot be captured in a CUDA graph; a
per-step exchange of every engine's count (vLLM's ``DPMetadata``) would save the
allgather backend's first collective.  A zero-token input (``[0, H]``, ``[0, k]``) takes
part in every collective (when every engine has zero tokens the allgather backend stops
after the counts, on every rank alike); ``moe_dummy_pass`` runs an idle
engine's share of one forward.  Shared experts (DeepSeek, Qwen2-MoE) are the model's and
stay TP-sliced inside each engine; nothing here touches them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator, ParallelState

BACKENDS = ("allgather_reducescatter", "alltoall")

# all_gather_single / reduce_scatter_single (torch >= 2.10) replace the *_tensor names,
# which now warn; the project supports torch >= 2.5, which has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExpertLayer(Protocol):
    """What a dispatcher needs of its layer: ``FusedMoE`` (``layer.py``), named by this
    protocol because that module imports this one."""

    num_experts: int
    num_local_experts: int
    hidden_size: int
    top_k: int
    act_dtype: torch.dtype

    def partial_sum(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: the pairs of global ``topk_ids`` on this rank's experts, others
        dropped (unreduced)."""
        ...

    def apply_local(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: ``x`` through this rank's experts by *local* ids."""
        ...

    def forward_topk(self, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor: ...


def spans_dp(state: ParallelState) -> bool:
    """Whether ``state``'s EP group spans data-parallel engines (EP = DP x TP > TP)."""
    return state.dp.world_size > 1 and \
        state.ep.world_size == state.dp.world_size * state.tp.world_size


class MoEDispatcher(ABC):
    """Moves a ``FusedMoE`` layer's tokens to its experts across the EP group and the
    results back.  ``__call__(layer, x [T, H], topk_weights [T, k], topk_ids [T, k]
    global ids) -> [T, H]``: the weighted sum over every token's experts, whichever rank
    holds them, equal on the engine's TP ranks.  Every rank of the EP group must call it
    for the same layers in the same order (each call is a fixed sequence of collectives),
    ``T`` may differ between engines (0 included) but not between an engine's TP ranks,
    and ``x`` must have the same dtype on every rank."""

    name: str

    def __init__(self, ep: GroupCoordinator, dp: GroupCoordinator,
                 tp: GroupCoordinator) -> None:
        if ep.world_size != dp.world_size * tp.world_size:
            raise ValueError(f"EP dispatch: the EP group ({ep.world_size} ranks) must be "
                             f"the DP x TP ranks ({dp.world_size} x {tp.world_size})")
        self.ep, self.dp, self.tp = ep, dp, tp

    @abstractmethod
    def __call__(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor: ...


class AllGatherReduceScatter(MoEDispatcher):
    """Every token to every EP rank; partial sums reduce-scattered back (module doc)."""

    name = "allgather_reducescatter"

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        k = topk_ids.shape[1]
        dp, group = self.dp.world_size, self.dp.device_group
        counts = torch.empty(dp, dtype=torch.int64, device=x.device)
        _all_gather(counts, torch.tensor([t], dtype=torch.int64, device=x.device),
                    group=group)
        t_max = int(counts.max())  # host sync: the padded size of the gathers
        if t_max == 0:  # every engine idle: the same answer on every rank, no more talk
            return torch.zeros_like(x)
        # One gather for the routing: weights and ids side by side in float32 (an
        # expert id is exact in float32 up to 2**24).  Padding rows get id -1, which no
        # rank owns, and weight 0, so every rank drops them (local_topk).
        route = torch.zeros(t_max, 2 * k, dtype=torch.float32, device=x.device)
        route[t:, k:] = -1
        route[:t, :k] = topk_weights
        route[:t, k:] = topk_ids
        xs = x.new_zeros(t_max, h)
        xs[:t] = x
        xg = x.new_empty(dp * t_max, h)
        rg = route.new_empty(dp * t_max, 2 * k)
        _all_gather(xg, xs, group=group)
        _all_gather(rg, route, group=group)
        weights = rg[:, :k].to(topk_weights.dtype)
        ids = rg[:, k:].to(topk_ids.dtype)
        partial = layer.partial_sum(xg, weights, ids)
        mine = x.new_empty(t_max, h)
        _reduce_scatter(mine, partial, group=group)  # sum over engines, own rows
        self.tp.all_reduce(mine)  # sum over the engine's TP ranks (their experts differ)
        return mine[:t]


class AllToAll(MoEDispatcher):
    """Each pair's row to its expert's rank and back (module doc)."""

    name = "alltoall"

    def __call__(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        k = topk_ids.shape[1]
        ep, e_local = self.ep.world_size, layer.num_local_experts
        # This TP rank's share of the engine's tokens: rows [lo, hi) of equal chunks.
        chunk = math.ceil(t / self.tp.world_size)
        lo = min(self.tp.rank_in_group * chunk, t)
        hi = min(lo + chunk, t)
        ids = topk_ids[lo:hi].reshape(-1)
        order = torch.argsort(ids, stable=True)  # pairs by global expert = by rank
        token = order // k
        sent = torch.bincount(ids, minlength=layer.num_experts)  # pairs per expert
        got = torch.empty_like(sent)  # [ep sources, e_local]: pairs for my experts
        dist.all_to_all_single(got, sent, group=self.ep.device_group)
        send_sizes = sent.view(ep, e_local).sum(1).tolist()  # host sync: split sizes
        got = got.view(ep, e_local)
        recv_sizes = got.sum(1).tolist()
        rows = x.new_empty(sum(recv_sizes), h)
        dist.all_to_all_single(rows, x[lo:hi].index_select(0, token), recv_sizes,
                               send_sizes, group=self.ep.device_group)
        if rows.shape[0]:
            # Rows arrive by source, then by local expert (the senders' sort order).
            local = torch.arange(e_local, device=x.device).repeat(ep)
            local = local.repeat_interleave(got.reshape(-1))
            ones = torch.ones(rows.shape[0], 1, dtype=topk_weights.dtype, device=x.device)
            rows = layer.apply_local(rows, ones, local[:, None])
        back = x.new_empty(order.shape[0], h)
        dist.all_to_all_single(back, rows, send_sizes, recv_sizes,
                               group=self.ep.device_group)
        weights = topk_weights[lo:hi].reshape(-1).index_select(0, order)
        share = x.new_zeros(hi - lo, h)
        share.index_add_(0, token, (back * weights[:, None]).to(x.dtype))
        if self.tp.world_size == 1 or t == 0:  # t is the engine's: its TP ranks agree
            return share
        padded = x.new_zeros(chunk, h)
        padded[:hi - lo] = share
        out = x.new_empty(self.tp.world_size * chunk, h)
        _all_gather(out, padded, group=self.tp.device_group)
        return out[:t]


def make_dispatcher(state: ParallelState) -> MoEDispatcher | None:
    """The dispatcher ``state.all2all_backend`` names, or None when the EP group does
    not span DP engines (then ``FusedMoE``'s TP-only path applies)."""
    if not spans_dp(state):
        return None
    kinds: dict[str, type[MoEDispatcher]] = {
        AllGatherReduceScatter.name: AllGatherReduceScatter, AllToAll.name: AllToAll}
    kind = kinds.get(state.all2all_backend)
    if kind is None:
        raise ValueError(f"all2all_backend must be one of {', '.join(BACKENDS)}, got "
                         f"{state.all2all_backend!r}")
    return kind(state.ep, state.dp, state.tp)


def moe_dummy_pass(model: nn.Module) -> None:
    """An idle engine's part of one forward: every ``FusedMoE`` of ``model`` that
    dispatches (has a ``MoEDispatcher``: all of them when the EP group spans DP
    engines), in ``model.modules()`` order -- the order a real forward reaches them --
    gets ``forward_topk`` with zero tokens (``[0, H]`` in the layer's activation dtype on
    its device, ``[0, top_k]`` float32 weights and int64 ids), so it joins the other
    engines' dispatch collectives and runs its experts on their tokens.  Nothing else
    runs: an engine's other layers have no collectives outside the engine."""
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(getattr(m, "dispatcher", None), MoEDispatcher):
                continue
            layer = cast(ExpertLayer, m)
            device = next(m.parameters()).device
            x = torch.empty(0, layer.hidden_size, dtype=layer.act_dtype, device=device)
            layer.forward_topk(
                x, torch.empty(0, layer.top_k, dtype=torch.float32, device=device),
                torch.empty(0, layer.top_k, dtype=torch.int64, device=device))
