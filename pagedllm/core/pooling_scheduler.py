"""The token-budget scheduler for pooling models (``runner="pooling"``): no KV cache.

A pooling request computes its whole prompt in one step and finishes with one vector,
so it never holds KV blocks and is never chunked or preempted::

 waiting (FCFS / priority / throughput order, as for generation)
    │  admitted whole while  sum(prompt tokens) <= max_num_batched_tokens
    │                   and  requests <= max_num_seqs
    ▼
 one step: runner pools every admitted prompt  ──►  finished, output = pooled vector

The queue, the budget, ``max_num_seqs``, aborts and the stats are the generative
``Scheduler``'s; only admission (no blocks), the step (whole prompts) and the result (a
vector, not a token) differ.  A prompt longer than the budget could never be admitted,
so ``add_request`` refuses it.  Decoder embedding models attend causally through a
per-step scratch KV of the runner (``worker/pooling_runner.py``): nothing persists
between steps, so the KV manager here is the smallest pool (two blocks), never used.
"""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet

from pagedllm.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pagedllm.request import Request, RequestStatus


class PoolingScheduler(Scheduler):
    def max_tokens_per_request(self) -> int:
        """A whole prompt runs in one step: the context or the step budget."""
        return min(self.config.max_model_len, self.config.max_num_batched_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a pooling request; ValueError if it could never be scheduled."""
        if request.pooling_params is None:
            raise ValueError("this engine runs a pooling model (runner 'pooling'): "
                             "requests need pooling_params, not sampling")
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        n, cap = request.num_prompt_tokens, self.max_tokens_per_request()
        if n > cap:
            raise ValueError(f"input: {n} tokens is more than the {cap} one pooling step "
                             "computes (max_model_len / max_num_batched_tokens)")
        self._track(request)
        self.waiting.add(request)

    def requires_sync(self) -> bool:
        return True  # each step's results finish its requests: nothing to overlap

    def schedule(self, *, in_flight_req_ids: AbstractSet[str] = frozenset(),
                 max_num_scheduled_reqs: int = 0) -> SchedulerOutput:
        """Admit whole prompts in queue order.  The pipeline limits are accepted and
        unused: ``requires_sync`` is always true, so the engine core never sets them."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new: list[NewRequestData] = []
        now = time.time()
        while len(self.waiting) > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            n = req.num_prompt_tokens
            if n > budget:
                break  # whole prompts only: it waits for the next step
            self.waiting.pop()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._add_running(req)
            num_scheduled[req.request_id] = n
            new.append(NewRequestData(req.request_id, req.prompt_token_ids, [],
                                      req.sampling_params, None, [], 0,
                                      pooling_params=req.pooling_params))
            budget -= n
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(new_reqs=new, cached_reqs=[],
                               num_scheduled_tokens=num_scheduled,
                               total_num_scheduled_tokens=sum(num_scheduled.values()),
                               finished_req_ids=finished)

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> EngineCoreOutputs:
        """Every scheduled request that is still live finishes with its vector."""
        outputs: list[EngineCoreOutput] = []
        for rid, vec in out.pooler_output.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.FINISHED_STOPPED
            self._remove_running(req)
            self._free(req)
            outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason=FinishReason.STOP,
                first_scheduled_time=req.first_scheduled_time, pooling_output=vec))
        stats = self.make_stats()
        stats.num_scheduled_tokens = sched.total_num_scheduled_tokens
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running),
                              num_waiting_reqs=len(self.waiting))
