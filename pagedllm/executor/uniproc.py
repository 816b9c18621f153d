"""The single-rank executor: the worker lives in the engine core's process."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.model_runner import StepHandle
from pagedllm.worker.startup_memory import out_of_memory_hint
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls go straight to the in-process ``Worker`` (no copy, no thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.init_device()
        # Out of memory in either phase: one line naming the flags to change.
        with out_of_memory_hint("model", config):
            self.worker.load_model()
        with out_of_memory_hint("kv", config):
            self.num_blocks = self.worker.determine_num_blocks()
            self.worker.initialize_cache(self.num_blocks)
        self.config = config.with_num_blocks(self.num_blocks)
        self.num_cpu_blocks = self.worker.num_cpu_blocks
        self.fill_step_sizes = self.worker.fill_step_sizes()
        self.step_cost = self.worker.step_cost_curve()

    def set_grammar_compiler(self, compiler: object) -> None:
        self.worker.set_grammar_compiler(compiler)

    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        return self.worker.execute_model_async(sched)

    def shutdown(self) -> None:
        self.worker.shutdown()
