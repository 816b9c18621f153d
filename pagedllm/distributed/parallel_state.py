"""Process groups for tensor and pipeline parallelism, created once per worker.

Rank layout (vLLM's): ``world = pp * tp`` ranks on one engine; global rank
``r = pp_rank * tp + tp_rank``, so a TP group is ``tp`` consecutive ranks and a PP group
is every ``tp``-th rank::

    tp=2, pp=2:      TP group 0: [0, 1]   (stage 0)     PP group 0: [0, 2]
                     TP group 1: [2, 3]   (stage 1)     PP group 1: [1, 3]

Data parallelism is engines, not ranks: each DP engine has its own world (its own
executor and ``torch.distributed`` rendezvous) -- except with expert parallelism, whose
experts are spread over every rank of every engine (EP size = DP x TP).  Then the
engines' ranks join one world of ``dp * pp * tp`` ranks, engine ``d``'s rank ``r`` being
global rank ``d * pp * tp + r``; the TP and PP groups stay inside an engine, the ``ep``
group is a stage's ``dp * tp`` ranks (engine-major) and the ``dp`` group links the ranks
at one (pp, tp) position of every engine::

    dp=2, tp=2:      TP groups [0, 1] [2, 3]    EP group [0, 1, 2, 3]    DP groups [0, 2] [1, 3]

How layers find their group: the worker builds a ``ParallelState`` once and enters
``parallel_context(state)`` while the model is built; a layer's constructor reads
``current_parallel_state()`` and keeps the ``GroupCoordinator`` it needs (no module
globals are mutated, no global rank is ever read by a layer).  Outside any context the
state is the single-rank one, so code and tests that build a model in-process are
unchanged.

Each group has a device group (NCCL on CUDA, gloo on CPU) for the collectives of the
forward, and a gloo CPU group for the start-up barrier, which on gloo can name the rank
that did not answer (``monitored_barrier``).  CUDA graphs: the collectives are issued on
the current stream through ``torch.distributed``, which NCCL (>= 2.9.6) lets a graph
capture; the capture itself is the model runner's (``worker/cuda_graphs.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group as seen by one rank: its members (global ranks, in group order),
    this rank's index in it, and the torch groups (None for a single-rank group)."""

    ranks: tuple[int, ...]
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (equal shapes) along ``dim``, in group order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``x`` with group member ``src``'s ``x`` (in place)."""
        if self.world_size > 1:
            dist.broadcast(x, self.ranks[src], group=self.device_group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point to group member ``dst`` (pipeline stages)."""
        dist.send(x.contiguous(), self.ranks[dst], group=self.device_group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``x`` from group member ``src``; returns ``x``."""
        dist.recv(x, self.ranks[src], group=self.device_group)
        return x

    def barrier(self, timeout_s: float, what: str) -> None:
        """Wait for every member, or raise ``RuntimeError`` naming this rank (and, on
        gloo, the ranks that did not arrive) after ``timeout_s``."""
        if self.world_size == 1:
            return
        try:
            dist.monitored_barrier(self.cpu_group,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"rank {self.ranks[self.rank_in_group]}: {what} timed out "
                               f"after {timeout_s:.0f} s ({msg})") from e


_SINGLE = GroupCoordinator(ranks=(0,), rank_in_group=0)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in its engine's world."""

    rank: int = 0
    world_size: int = 1
    tp: GroupCoordinator = _SINGLE
    pp: GroupCoordinator = _SINGLE
    # Every rank of the engine (the start-up barrier and warm-up collective run over it).
    world: GroupCoordinator = _SINGLE
    # Expert parallelism (``enable_expert_parallel``): the ranks that split a MoE layer's
    # experts between them -- the TP group, or with data parallelism every engine's TP
    # ranks of this stage (engine-major); single-rank when expert parallelism is off, so
    # MoE layers keep every expert.
    ep: GroupCoordinator = _SINGLE
    # Expert parallelism across data-parallel engines only: the ranks at this rank's
    # (pp, tp) position in every engine (their tokens differ, so MoE layers dispatch
    # tokens to their experts' ranks: ``layers/fused_moe/dispatch.py``).
    dp: GroupCoordinator = _SINGLE
    # How those MoE layers move tokens (vLLM's ``all2all_backend`` names):
    # "allgather_reducescatter" or "alltoall".
    all2all_backend: str = "allgather_reducescatter"

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group

    @property
    def dp_size(self) -> int:
        return self.dp.world_size


SINGLE_RANK = ParallelState()
_current: ContextVar[ParallelState] = ContextVar("pagedllm_parallel_state",
                                                 default=SINGLE_RANK)


def current_parallel_state() -> ParallelState:
    """The state entered with ``parallel_context`` (single-rank outside one)."""
    return _current.get()


@contextlib.contextmanager
def parallel_context(state: ParallelState) -> Iterator[ParallelState]:
    """Build (and run) a model as ``state``'s rank: layers take their groups from it."""
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Stage ``pp_rank``'s contiguous ``[start, end)`` of ``num_layers`` decoder layers;
    earlier stages take the remainder (vLLM's even split)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def init_parallel_state(tp_size: int, pp_size: int, rank: int, init_method: str,
                        backend: str, timeout_s: float,
                        expert_parallel: bool = False, dp_size: int = 1, dp_rank: int = 0,
                        all2all_backend: str = "allgather_reducescatter") -> ParallelState:
    """Join the engine's world (``tp_size * pp_size`` ranks at ``init_method``, e.g.
    ``tcp://127.0.0.1:PORT``) and create its TP and PP groups (``expert_parallel``: the
    TP group is the EP group too).  Every rank calls this with the same arguments but its
    own ``rank`` (in its engine).  With ``expert_parallel`` and ``dp_size > 1`` the world
    is every engine's ranks (``dp_rank``: this engine) and the EP and DP groups span the
    engines (module doc).  Raises ``RuntimeError`` naming the rank when the rendezvous or
    the start-up barrier does not complete in ``timeout_s``."""
    span_dp = expert_parallel and dp_size > 1
    engine_world = tp_size * pp_size
    world = engine_world * (dp_size if span_dp else 1)
    base = engine_world * dp_rank if span_dp else 0  # this engine's first global rank
    grank = base + rank
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend, init_method=init_method, world_size=world,
                                rank=grank, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"rank {grank}: joining the {world}-rank world at "
                           f"{init_method} failed within {timeout_s:.0f} s ({msg})") from e

    def group(ranks: list[int]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        c = g if backend == "gloo" else dist.new_group(ranks, backend="gloo",
                                                       timeout=timeout)
        return g, c

    pp_rank, tp_rank = divmod(rank, tp_size)
    engines = range(dp_size if span_dp else 1)
    tp = pp = ep = dp = None
    # new_group must be called by every rank for every group, in the same order.
    for d in engines:
        first = d * engine_world
        for p in range(pp_size):
            ranks = list(range(first + p * tp_size, first + (p + 1) * tp_size))
            g, c = group(ranks)
            if grank in ranks:
                tp = GroupCoordinator(tuple(ranks), tp_rank, g, c)
        for t in range(tp_size):
            ranks = list(range(first + t, first + engine_world, tp_size))
            g, c = group(ranks)
            if grank in ranks:
                pp = GroupCoordinator(tuple(ranks), pp_rank, g, c)
    if span_dp:
        for p in range(pp_size):
            ranks = [d * engine_world + p * tp_size + t for d in engines
                     for t in range(tp_size)]
            g, c = group(ranks)
            if grank in ranks:
                ep = GroupCoordinator(tuple(ranks), ranks.index(grank), g, c)
        for r in range(engine_world):
            ranks = [d * engine_world + r for d in engines]
            g, c = group(ranks)
            if grank in ranks:
                dp = GroupCoordinator(tuple(ranks), dp_rank, g, c)
    assert tp is not None and pp is not None
    world_cpu = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    state = ParallelState(
        rank=rank, world_size=engine_world, tp=tp, pp=pp,
        ep=ep or (tp if expert_parallel else _SINGLE), dp=dp or _SINGLE,
        all2all_backend=all2all_backend,
        # device_group None: the default (world) group.
        world=GroupCoordinator(tuple(range(world)), grank, None, world_cpu))
    state.world.barrier(timeout_s, "the start-up barrier")
    if backend == "nccl":
        # Create the NCCL communicators now, eagerly: a CUDA graph may capture a
        # collective only once its communicator exists (graphs are captured later).
        one = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
        state.tp.all_reduce(one)
        if pp_size > 1:
            state.pp.all_reduce(one)
        for g in (state.ep, state.dp):
            g.all_reduce(one)
        state.world.all_reduce(one)
        torch.cuda.synchronize()
    return state


def destroy_parallel_state() -> None:
    """Leave the world (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
