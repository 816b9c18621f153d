"""Data parallelism: several engine cores behind one frontend, balanced by load.

::

    AsyncLLM ──► DPClient ──► AsyncMPClient 0 ──► engine core 0 (its own executor/ranks)
                    │    └──► AsyncMPClient 1 ──► engine core 1
                    └── one merged output stream, stats summed over engines

``DPClient`` has ``AsyncMPClient``'s interface, so ``AsyncLLM`` and the server are
unchanged.  Each core is a full engine (scheduler, KV cache, executor); they share
nothing, so a request lives on one engine from start to finish.

Balancing: a new request goes to the engine that already holds most of its prompt in
its prefix cache, unless that engine is clearly busier (``engine/dp_routing.py``;
``data_parallel_routing="prefix"``, the default), else -- and always under
``data_parallel_routing="load"`` -- to the engine with the fewest unfinished sequences
sent to it (exact: counted here as requests are sent and finish), then the fewest
waiting in its last reported stats, then the lowest KV-cache usage.  An ``n > 1``
request goes whole to one engine (its sequences share the prompt's blocks there).

Each engine gets its index (``data_parallel_rank``): on CUDA its ranks take their own
devices, engine ``d`` the ``tp * pp`` devices after engines ``0..d-1``'s.  Expert
parallelism (``enable_expert_parallel``) spreads each MoE layer's experts over every
engine's ranks: the engines then also get two loopback ports (``engine_configs``), their
ranks join one world and the cores step in lockstep (``engine/dp_lockstep.py``).
Requests are still balanced as above.

Failure: when any engine dies or fails a step, ``get_output`` raises
``EngineDeadError`` naming it, so in-flight requests error, ``/health`` turns 503 and
the server shuts every engine down (no engine keeps running unsupervised).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import prefix_extra_key
from pagedllm.engine.core_proc import EngineCoreReady
from pagedllm.engine.dp_routing import PrefixRouter, check_routing
from pagedllm.engine.mp_client import AsyncMPClient, EngineDeadError
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


def engine_configs(config: Any, num_engines: int) -> list[Any]:
    """Each engine's ``EngineConfig`` or ``EngineArgs``: ``config`` with the engine's
    ``data_parallel_rank`` (its ranks take their own devices: ``worker.device_index``),
    and when experts span the engines the two ports they share (the ranks' rendezvous
    and the cores' lockstep)."""
    if num_engines == 1:
        return [config]
    pc = config.parallel_config if isinstance(config, EngineConfig) else config
    ports: dict[str, int] = {}
    if pc.enable_expert_parallel:
        # Both bound by engine 0's processes a moment later (free_port imports no torch).
        from pagedllm.executor.process_start import free_port

        master = rpc = free_port()
        while rpc == master:  # the OS may hand the same free port out twice
            rpc = free_port()
        ports = {"data_parallel_master_port": master, "data_parallel_rpc_port": rpc}
    if isinstance(config, EngineConfig):
        return [dataclasses.replace(config, parallel_config=dataclasses.replace(
            config.parallel_config, data_parallel_rank=d, **ports))
            for d in range(num_engines)]
    return [dataclasses.replace(config, data_parallel_rank=d, **ports)
            for d in range(num_engines)]


class DPClient:
    """``data_parallel_size`` engine cores as one (see the module doc)."""

    def __init__(self, config: Any, num_engines: int, *, transport: str = "ipc") -> None:
        pc = config.parallel_config if isinstance(config, EngineConfig) else config
        self.routing = check_routing(getattr(pc, "data_parallel_routing", "prefix"))
        self.clients = [AsyncMPClient(c, transport=transport)
                        for c in engine_configs(config, num_engines)]
        self.router: PrefixRouter | None = None  # built at start (needs the block size)
        self.ready: EngineCoreReady | None = None
        self.dead: EngineDeadError | None = None
        # Per engine: unfinished sequences sent to it, and its last reported stats.
        self.outstanding = [0] * num_engines
        self.assigned = [0] * num_engines  # sequences ever sent (for metrics)
        self.engine_stats: list[SchedulerStats] = [SchedulerStats()] * num_engines
        self._owner: dict[str, int] = {}  # sequence id -> engine index
        self._queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []

    async def start(self, timeout: float = 900.0) -> EngineCoreReady:
        """Start every engine (concurrently); the first one's ``EngineCoreReady``, with
        ``num_blocks`` summed over engines."""
        try:
            readies = await asyncio.gather(*(c.start(timeout) for c in self.clients))
        except BaseException:
            self.shutdown()
            raise
        first = readies[0]
        self.ready = EngineCoreReady(
            pid=first.pid, num_blocks=sum(r.num_blocks for r in readies),
            block_size=first.block_size, max_model_len=first.max_model_len,
            max_num_seqs=sum(r.max_num_seqs for r in readies),
            max_tokens_per_request=min(r.max_tokens_per_request for r in readies),
            device=first.device, dtype=first.dtype)
        if self.routing == "prefix":
            self.router = PrefixRouter(len(self.clients), first.block_size)
            for i, r in enumerate(readies):
                self.router.set_capacity(i, r.num_blocks)
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read(i)) for i in range(len(self.clients))]
        logger.info("%d data-parallel engines ready (pids %s), requests routed by %s",
                    len(self.clients), [r.pid for r in readies],
                    "cached prefix, then load" if self.router else "load")
        return self.ready

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.clients]

    def is_alive(self) -> bool:
        return self.dead is None and all(c.is_alive() for c in self.clients)

    def heartbeat_age(self) -> float:
        return max(c.heartbeat_age() for c in self.clients)

    # ------------------------------------------------------------------ balancing

    def pick_engine(self) -> int:
        """The least-loaded engine (see the module doc)."""
        return min(range(len(self.clients)), key=lambda i: (
            self.outstanding[i], self.engine_stats[i].num_waiting_reqs,
            self.engine_stats[i].kv_cache_usage, i))

    @property
    def routed_by_prefix(self) -> list[int]:
        """Per engine, sequences sent there because it held at least half of their
        prompt's blocks (``dp_routing``); zeros under ``data_parallel_routing="load"``."""
        return self.router.routed_by_prefix if self.router else [0] * len(self.clients)

    def route(self, request: EngineCoreRequest) -> int:
        """The engine for ``request`` (module doc)."""
        if self.router is None:
            return self.pick_engine()
        return self.router.pick(request.prompt_token_ids, self.outstanding,
                                self.pick_engine, root=prefix_extra_key(
                                    request.sampling_params, request.lora_request))

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if self.dead is not None:
            raise self.dead
        i = self.route(requests[0])
        for r in requests:
            for sid in (r.request_id, *r.fork_ids):
                self._owner[sid] = i
                self.outstanding[i] += 1
                self.assigned[i] += 1
        await self.clients[i].add_requests(requests)

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.get(rid)
            if i is not None:
                by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            await self.clients[i].abort_requests(ids)

    # ------------------------------------------------------------------ outputs

    async def _read(self, i: int) -> None:
        try:
            while True:
                out = await self.clients[i].get_output()
                if out.scheduler_stats is not None:
                    self.engine_stats[i] = st = out.scheduler_stats
                    if self.router is not None and st.num_total_blocks > 0:
                        self.router.set_capacity(  # what its cache can hold now
                            i, st.num_total_blocks + st.kv_offload_total_blocks
                            + st.kv_offload_disk_total_blocks)
                for o in out.outputs:
                    if o.finished and self._owner.pop(o.request_id, None) is not None:
                        self.outstanding[i] -= 1
                self._queue.put_nowait(out)
        except EngineDeadError as e:
            logger.error("data-parallel engine %d (pid %s) is dead: %s", i,
                         self.clients[i].pid, e)
            self._queue.put_nowait(EngineDeadError(f"data-parallel engine {i}: {e}"))
        except asyncio.CancelledError:
            raise

    async def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any engine; their ``scheduler_stats`` replaced by the sum
        over engines (gauges in total; per-step counters of the reporting engine)."""
        if self.dead is not None:
            raise self.dead
        item = await self._queue.get()
        if isinstance(item, EngineDeadError):
            self.dead = item
            raise item
        if item.scheduler_stats is not None:
            item.scheduler_stats = self._total(item.scheduler_stats)
        return item

    def _total(self, step: SchedulerStats) -> SchedulerStats:
        """``step`` (one engine's snapshot) with its gauges replaced by the engines'
        totals; every per-step counter (tokens scheduled, preemptions, prefix-cache and
        tier lookups, speculative-decoding drafts) stays the reporting engine's, since
        each engine's snapshot reaches the metrics once."""
        s = self.engine_stats
        free, total = sum(x.num_free_blocks for x in s), sum(x.num_total_blocks for x in s)
        return msgspec.structs.replace(
            step,
            num_running_reqs=sum(x.num_running_reqs for x in s),
            num_waiting_reqs=sum(x.num_waiting_reqs for x in s),
            kv_cache_usage=(1.0 - free / total) if total else 0.0,
            num_free_blocks=free, num_total_blocks=total,
            kv_offload_usage=_pooled_usage(s, "kv_offload_usage", "kv_offload_total_blocks"),
            kv_offload_total_blocks=sum(x.kv_offload_total_blocks for x in s),
            kv_offload_disk_usage=_pooled_usage(s, "kv_offload_disk_usage",
                                                "kv_offload_disk_total_blocks"),
            kv_offload_disk_total_blocks=sum(x.kv_offload_disk_total_blocks for x in s))

    def shutdown(self) -> None:
        for t in self._readers:
            t.cancel()
        for c in self.clients:
            c.shutdown()


def _pooled_usage(stats: list[SchedulerStats], usage: str, blocks: str) -> float:
    """The fill of the engines' pools taken together: each engine's ``usage`` fraction
    weighted by its ``blocks`` (0 when no engine has the pool)."""
    total = sum(getattr(x, blocks) for x in stats)
    return sum(getattr(x, usage) * getattr(x, blocks) for x in stats) / total \
        if total else 0.0
