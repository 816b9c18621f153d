"""The ``ray`` executor: one Ray actor per rank, placed by a placement group.

The engine core must run inside a Ray session (``ray.init(...)`` or ``ray start`` with
``RAY_ADDRESS``); a new placement group reserves one bundle per rank (``{"GPU": 1}`` on
CUDA, ``{"CPU": threads}`` on CPU) with the ``PACK`` strategy, so ranks fill a node
before spilling to the next, and TP groups (consecutive ranks) stay on one node when
they fit.  Rank 0's actor names the rendezvous (its node's IP and a free port), so the
world spans nodes.

Each step is encoded once (msgpack, msgspec) and put in Ray's object store once; every
actor receives the same object (Ray ships it once per node) and only the output rank
returns its ``ModelRunnerOutput`` bytes.  A dead actor (``RayActorError``), a failed
step (``RayTaskError``) or a step that does not finish within
``distributed_timeout_seconds`` raises ``ExecutorError`` naming the rank; ``shutdown()``
kills the actors and removes the placement group.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor, ExecutorError, output_rank
from pagedllm.executor.process_start import free_port
from pagedllm.executor.worker_proc import (
    ENCODER,
    OUTPUT_DECODER,
    SAMPLED_DECODER,
    SCHED_DECODER,
    SampledTokens,
    first_line,
)

logger = logging.getLogger("pagedllm")


class RayWorkerWrapper:
    """The actor body: a ``Worker`` and the calls the executor makes on it."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.is_output_rank = False

    def rendezvous(self) -> str:
        """``tcp://this-node-ip:free-port`` (called on rank 0 only)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port('')}"

    def start(self, config: EngineConfig, rank: int, init_method: str,
              is_output_rank: bool) -> int:
        """Join the world, load the model; returns this rank's KV block count."""
        import ray

        from pagedllm.worker.worker import Worker

        gpus = ray.get_gpu_ids()
        self.worker = Worker(config, rank, 0 if gpus else rank, init_method)
        self.is_output_rank = is_output_rank
        self.worker.init_device()
        self.worker.load_model()
        return int(self.worker.determine_num_blocks())

    def initialize_cache(self, num_blocks: int,
                         ) -> tuple[int, list[int], dict[str, Any] | None]:
        self.worker.initialize_cache(num_blocks)
        return (int(self.worker.num_cpu_blocks), list(self.worker.fill_step_sizes()),
                self.worker.step_cost_curve())

    def execute(self, payload: bytes, sampled: bytes | None = None) -> bytes | None:
        if sampled is not None:  # pipeline parallelism: see worker_proc.SampledTokens
            s = SAMPLED_DECODER.decode(sampled)
            self.worker.record_sampled_tokens(s.req_ids, s.sampled_token_ids)
        out = self.worker.execute_model(SCHED_DECODER.decode(payload))
        return ENCODER.encode(out) if self.is_output_rank else None

    def pid(self) -> int:
        return os.getpid()


class _RayStep:
    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor, self.refs = executor, refs
        self.out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.out is None:
            payload = self.executor._get(self.refs, "run the step")[
                self.executor.output_rank]
            self.out = OUTPUT_DECODER.decode(payload)
            if self.executor._sampled is not None:
                self.executor._sampled.add(self.out)
        return self.out


class RayExecutor(Executor):
    """See the module doc."""

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # A session this executor starts (a local one, no RAY_ADDRESS) is its to stop:
        # its daemons are this process's children.
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.timeout = pc.distributed_timeout_seconds
        self.output_rank = output_rank(config)
        self.failed: ExecutorError | None = None
        self._closed = False
        # Pipeline parallelism: tokens read since the last launch, for the early stages.
        self._sampled: SampledTokens | None = SampledTokens() \
            if pc.pipeline_parallel_size > 1 else None
        cuda = config.device_config.device == "cuda"
        threads = config.device_config.num_threads or 1
        bundle = {"GPU": 1.0} if cuda else {"CPU": float(threads)}
        self._remove_pg = remove_placement_group
        self.pg = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        self.actors: list[Any] = []
        try:
            self._get([self.pg.ready()], "reserve its placement-group bundle",
                      self.timeout)
            cls = ray.remote(RayWorkerWrapper)
            for rank in range(self.world_size):
                self.actors.append(cls.options(
                    num_cpus=0 if cuda else threads, num_gpus=1 if cuda else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=rank)).remote())
            t0 = time.perf_counter()
            init_method = self._get([self.actors[0].rendezvous.remote()],
                                    "name the rendezvous")[0]
            blocks = self._get([a.start.remote(config, r, init_method,
                                               r == self.output_rank)
                                for r, a in enumerate(self.actors)],
                               "load the model", self.timeout + 600.0)
            self.num_blocks = min(blocks)
            logger.info("%d Ray ranks ready in %.1f s; KV blocks per rank %s -> %d",
                        self.world_size, time.perf_counter() - t0, blocks, self.num_blocks)
            caches = self._get([a.initialize_cache.remote(self.num_blocks)
                                for a in self.actors], "allocate its KV cache")
            self.num_cpu_blocks, self.fill_step_sizes, self.step_cost = \
                caches[self.output_rank]
            self.config = config.with_num_blocks(self.num_blocks)
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: list[Any], what: str, timeout: float | None = None) -> list[Any]:
        """``ray.get`` with the executor's timeout; failures become ``ExecutorError``
        naming the rank (the index into ``refs``)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        if self.failed is not None:
            raise self.failed
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        done: dict[int, Any] = {}
        pending = dict(enumerate(refs))
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._fail(f"rank {min(pending)} did not {what} within "
                                 f"{timeout:.0f} s (ranks still busy: {sorted(pending)})")
            rank = next(r for r, ref in pending.items() if ref == ready[0])
            try:
                done[rank] = ray.get(pending.pop(rank))
            except RayActorError as e:
                raise self._fail(f"rank {rank} died ({first_line(e)})") from None
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                raise self._fail(f"rank {rank} failed: {first_line(cause)}") from None
            except GetTimeoutError:  # pragma: no cover - ray.wait said it is ready
                raise self._fail(f"rank {rank} did not {what}") from None
        return [done[r] for r in range(len(refs))]

    def _fail(self, msg: str) -> ExecutorError:
        self.failed = ExecutorError(msg)
        logger.error("executor: %s", msg)
        return self.failed

    def execute_model_async(self, sched: SchedulerOutput) -> _RayStep:
        import ray

        if self.failed is not None:
            raise self.failed
        payload = ray.put(ENCODER.encode(sched))  # once, whatever the number of ranks
        sampled = None
        if self._sampled is not None:
            sampled = ray.put(ENCODER.encode(self._sampled))
            self._sampled = SampledTokens()
        return _RayStep(self, [a.execute.remote(payload, sampled) for a in self.actors])

    def check_health(self) -> None:
        if self.failed is not None:
            raise self.failed

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already dead: nothing to stop
                pass
        try:
            self._remove_pg(self.pg)
        except Exception:  # the Ray session is gone already
            pass
        if self._owns_ray:
            ray.shutdown()
