"""The executor: between the engine core and its workers (one per rank).

::

    EngineCore ── SchedulerOutput ──► Executor ──► Worker rank 0 ┐  (TP x PP ranks,
        ▲                               │  once ├─► Worker rank 1 ├─ torch.distributed
        └──── ModelRunnerOutput ◄───────┘       └─► ...          ┘   among themselves)
              (from the output rank only)

Backends (``ParallelConfig.distributed_executor_backend``):

* ``uni`` (``uniproc.py``): one rank, in the core's process; calls go straight to the
  worker (no copy, no thread: today's single-device path unchanged).
* ``mp`` (``multiproc.py``): one spawned process per rank on this host; the step is
  broadcast once over a ZeroMQ PUB socket as msgpack (msgspec), the output rank answers
  on a PULL socket.
* ``ray`` (``ray_executor.py``): one Ray actor per rank, placed by a placement group
  (across nodes); the msgpack step is put in Ray's object store once per step.

Contract for the core: the constructor starts the ranks, loads the model, sizes the KV
cache (the minimum over ranks: one block table serves all) and allocates it; then
``execute_model_async(sched)`` returns a handle whose ``result()`` is that step's
``ModelRunnerOutput``; handles are resolved in launch order.  A rank that dies, fails
or stays silent past ``distributed_timeout_seconds`` raises ``ExecutorError`` naming
it, and ``shutdown()`` leaves no process behind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A rank died, failed or hung.  The message names the rank; no traceback."""


class StepResult(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """See the module doc.  After construction: ``config`` (with ``num_blocks``),
    ``num_blocks``, ``num_cpu_blocks``, ``fill_step_sizes`` and ``step_cost`` (the
    output rank's measured step-cost curve as ``StepCostCurve.to_dict``, with
    speculative decoding; else None)."""

    config: EngineConfig
    num_blocks: int
    num_cpu_blocks: int
    fill_step_sizes: list[int]
    step_cost: dict[str, Any] | None = None

    @abstractmethod
    def execute_model_async(self, sched: SchedulerOutput) -> StepResult:
        """Launch one step on every rank."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def set_grammar_compiler(self, compiler: object) -> None:
        """Give the ranks' runners the core's structured-output grammar compiler.  Only
        the in-process executor can: compiled grammars live in the core's process."""
        raise ValueError("structured_outputs: not supported with tensor or pipeline "
                         "parallelism yet (grammars are compiled in the engine core's "
                         "process); use tensor_parallel_size=1 and pipeline_parallel_size=1")

    def check_health(self) -> None:  # noqa: B027
        """``ExecutorError`` when a rank is gone (cheap: no message to the ranks)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""


def output_rank(config: EngineConfig) -> int:
    """The rank whose output the core reads: TP rank 0 of the last pipeline stage
    (rank 0 without pipeline parallelism)."""
    pc = config.parallel_config
    return pc.world_size - pc.tensor_parallel_size
