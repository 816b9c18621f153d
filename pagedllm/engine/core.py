"""EngineCore: the scheduler and the worker, stepped together.

``step()`` = schedule -> execute -> update.  The core sees tokens only (no text): single
sequences, and n-sequence groups sharing a prompt; it runs in the caller's process for the
offline ``LLM`` and in a process of its own behind the API server (``core_proc.py``),
unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.pooling_scheduler import PoolingScheduler
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.step_trace import StepTrace
from pagedllm.executor.base import StepResult
from pagedllm.executor.factory import make_executor
from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from pagedllm.request import Request
from pagedllm.spec_decode.policy import StepCostCurve

logger = logging.getLogger("pagedllm")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        # The ranks (one in process, or processes / Ray actors): executor/base.py.
        self.executor = make_executor(config)
        self.num_blocks = self.executor.num_blocks
        self.config = self.executor.config
        # A pooling model (runner "pooling") runs whole prompts without KV blocks.
        scheduler_cls = PoolingScheduler if config.model_config.runner == "pooling" \
            else Scheduler
        # Speculative decoding: the policy's measured step-cost curve (worker/step_cost.py).
        cost = self.executor.step_cost
        extra = {"step_cost": StepCostCurve.from_dict(cost)} if cost is not None else {}
        self.scheduler = scheduler_cls(config.scheduler_config, config.cache_config,
                                   self.num_blocks, self.executor.num_cpu_blocks,
                                   self.executor.fill_step_sizes, **extra)
        self.max_model_len = config.model_config.max_model_len
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._inflight: tuple[SchedulerOutput, StepResult] | None = None
        # Pipeline parallelism: up to one batch in flight per stage (``_step_pipelined``).
        self.pipeline_depth = config.parallel_config.pipeline_parallel_size
        self._batches: deque[tuple[SchedulerOutput, StepResult]] = deque()
        # The most batches ever in flight at once (> 1: the stages overlapped).
        self.max_batches_in_flight = 0
        self.trace = StepTrace.from_env()  # PAGEDLLM_STEP_TRACE: per-step timings
        # Structured outputs: requests wait here while their grammar compiles (built on
        # the first such request, so that plain serving never imports xgrammar).
        self._grammar_gate: Any = None
        self._engine_config = config
        # Experts across data-parallel engines (engine/dp_lockstep.py): every ``step()``
        # runs exactly one model step, an empty one when this engine has no work.
        self.lockstep = config.parallel_config.expert_parallel_spans_dp
        sc = config.scheduler_config
        logger.info("engine ready in %.1f s: max_num_seqs=%d, max_num_batched_tokens=%d, "
                    "policy=%s, async_scheduling=%s", time.perf_counter() - t0,
                    sc.max_num_seqs, sc.max_num_batched_tokens, sc.policy,
                    sc.async_scheduling)

    @property
    def max_tokens_per_request(self) -> int:
        return self.scheduler.max_tokens_per_request()

    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises ValueError if the request could never fit the KV pool."""
        request = Request.from_engine_core_request(req)
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        self._gate().add(request)

    def _gate(self) -> Any:
        if self._grammar_gate is None:
            from pagedllm.engine.input_processor import load_tokenizer
            from pagedllm.structured_output.gate import GrammarGate

            config = self._engine_config
            gate = GrammarGate(lambda: load_tokenizer(config), config.model_config.vocab_size)
            self.executor.set_grammar_compiler(gate.compiler)  # ValueError: not here
            self._grammar_gate = gate
        return self._grammar_gate

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar is compiled into the scheduler; abort the rest."""
        ready, failed = self._grammar_gate.ready()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as e:  # the frontend checks sizes first; a backstop
                logger.warning("request %s rejected: %s", request.request_id, e)
                failed.append(request)
        return [EngineCoreOutput(request_id=sid, new_token_ids=[],
                                 finish_reason=FinishReason.ABORT)
                for r in failed for sid in (r.request_id, *r.fork_ids)]

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._grammar_gate is not None:
            self._grammar_gate.abort(request_ids)
        self.scheduler.finish_requests(request_ids)
        if not self.scheduler.has_unfinished_requests():
            # What is in flight serves only aborted requests now.
            if self._inflight is not None:
                self._finish_inflight()
            while self._batches:
                self._finish_oldest_batch()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None
                or bool(self._batches) or bool(self._grammar_gate))

    def step(self) -> EngineCoreOutputs:
        """One engine step (``_step``), after admitting requests whose grammar has
        compiled meanwhile.  With only compiling requests left, it waits briefly for one
        (not in ``lockstep``, where a step always runs the model, empty or not)."""
        if not self._grammar_gate:
            return self._step()
        failed = self._admit_compiled()
        if not self.lockstep and not self.scheduler.has_unfinished_requests() \
                and self._inflight is None:
            if not failed:
                self._grammar_gate.wait(0.05)
                failed = self._admit_compiled()
            if not self.scheduler.has_unfinished_requests():
                return EngineCoreOutputs(outputs=failed,
                                         scheduler_stats=self.scheduler.make_stats(),
                                         timestamp=time.time())
        out = self._step()
        out.outputs.extend(failed)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def _step(self) -> EngineCoreOutputs:
        """One engine step.  With async scheduling, step N+1 is scheduled and launched
        before step N's tokens are read back, so the host's work (updating requests,
        scheduling, building inputs) overlaps the device's; the outputs returned are
        step N's.  Requests that need every token before the next step (penalties,
        min_tokens, forks, beams, prompt logprobs, swap) switch it off while live."""
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        if not self.async_scheduling:
            t_wall, t0 = time.time(), time.perf_counter()
            sched = self.scheduler.schedule()
            t1 = time.perf_counter()
            result = self.executor.execute_model(sched)
            t2 = time.perf_counter()
            outputs = self.scheduler.update_from_output(sched, result)
            if self.trace is not None:  # synchronous: "launch" includes the device time
                self.trace.record(sched, t_wall, t0, t1, t2, t2, time.perf_counter())
            return outputs
        sync = self.scheduler.requires_sync()
        if sync and self._inflight is not None:
            return self._finish_inflight()  # drain; the next call runs synchronously
        t_wall, t0 = time.time(), time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        handle = self.executor.execute_model_async(sched)
        if sync:
            return self.scheduler.update_from_output(sched, handle.result())
        prev, self._inflight = self._inflight, (sched, handle)
        t2 = time.perf_counter()
        if prev is None:  # nothing to wait for yet
            if self.trace is not None:
                self.trace.record(sched, t_wall, t0, t1, t2, t2, t2)
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(),
                                     timestamp=time.time())
        result = prev[1].result()
        t3 = time.perf_counter()
        outputs = self.scheduler.update_from_output(prev[0], result)
        if self.trace is not None:
            self.trace.record(sched, t_wall, t0, t1, t2, t3, time.perf_counter())
        if not self.scheduler.has_unfinished_requests():
            # The step in flight only serves requests that have just finished: settle it
            # now so an idle engine holds nothing in flight.
            self._finish_inflight()
        return outputs

    def _step_pipelined(self) -> EngineCoreOutputs:
        """One step with pipeline parallelism: vLLM's batch queue.  Up to
        ``pipeline_depth`` batches of disjoint requests are in flight, so each stage
        works on its own micro-batch instead of waiting for the others::

            stage 0   A B C D ...        A, B: two batches launched back to back;
            stage 1     A B C D ...      C (A's requests again) after A's output

        A call launches one batch when the queue has room and the scheduler finds work
        outside the batches in flight (``schedule``'s ``in_flight_req_ids``), with at
        most 1/depth of the live requests (``max_num_scheduled_reqs``); it returns
        nothing while the queue is still filling, else the oldest batch's outputs
        (outputs are consumed in launch order).  Requests that need every token on the
        host (``requires_sync``) drain the queue and run one batch at a time."""
        batches = self._batches
        sync = self.scheduler.requires_sync()
        if sync and batches:
            return self._finish_oldest_batch()
        if len(batches) < self.pipeline_depth:
            sc = self.scheduler
            in_flight = set().union(*(s.num_scheduled_tokens for s, _ in batches))
            # Spread the live requests over the stages (a batch with all of them would
            # leave the next one empty and the stages taking turns).
            max_reqs = 0 if sync else -(-len(sc.requests) // self.pipeline_depth) or 1
            sched = sc.schedule(in_flight_req_ids=in_flight, max_num_scheduled_reqs=max_reqs)
            # A batch with nothing to do is worth launching only for its diffs (finished
            # or preempted requests...) or when nothing else is in flight.
            if not batches or not _carries_nothing(sched):
                batches.append((sched, self.executor.execute_model_async(sched)))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(batches))
                if not sync and len(batches) < self.pipeline_depth:
                    return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(),
                                             timestamp=time.time())
        return self._finish_oldest_batch()

    def _finish_oldest_batch(self) -> EngineCoreOutputs:
        sched, handle = self._batches.popleft()
        return self.scheduler.update_from_output(sched, handle.result())

    def _finish_inflight(self) -> EngineCoreOutputs:
        assert self._inflight is not None
        sched, handle = self._inflight
        self._inflight = None
        return self.scheduler.update_from_output(sched, handle.result())

    def shutdown(self) -> None:
        """Stop the grammar compiler's threads and the ranks, and drop the steps in
        flight (they hold the runner's buffers); idempotent."""
        if self._grammar_gate is not None:
            self._grammar_gate.shutdown()
        if self.trace is not None:
            self.trace.close()
        self._inflight = None
        self._batches.clear()
        self.executor.shutdown()


def _carries_nothing(sched: SchedulerOutput) -> bool:
    """No tokens to compute and no diff for the runners."""
    return not (sched.total_num_scheduled_tokens or sched.finished_req_ids
                or sched.preempted_req_ids or sched.forks or sched.swap_out
                or sched.swap_in or sched.block_copies or sched.kv_offload
                or sched.kv_load)
