"""The phase-less token-budget scheduler.

Each step has a budget of ``max_num_batched_tokens``.  Every request wants
``num_tokens - num_computed_tokens`` more tokens computed: a whole prompt, the rest of
a prompt (chunked prefill), or one token (decode).  The scheduler grants them in order:

```
 budget ──► running requests (oldest first; decodes and unfinished prompt chunks)
        │     no blocks left?  preempt the lowest-priority / newest running request
        │     (recompute: free its blocks, reset num_computed_tokens, back to waiting)
        └─► waiting requests (FCFS or priority) while budget, blocks and
            max_num_seqs allow -- skipped in a step that had to preempt
```

A prompt longer than the remaining budget is cut into a chunk; the rest comes next step,
mixed with other requests' decode tokens.  Work per step is O(number of requests): no
loop here ever runs over a request's tokens (block hashing is incremental and amortised).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.request_queue import make_queue
from pagedllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    SchedulerStats,
)
from pagedllm.request import Request, RequestStatus


class Scheduler:
    """Owns every unfinished request and the waiting/running queues."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests the runner must drop at the next step.
        self._finished_ids: set[str] = set()
        self._num_preemptions_step = 0
        self.total_preemptions = 0

    # -- admission -----------------------------------------------------------------
    def max_tokens_per_request(self) -> int:
        """The most tokens one request may ever hold: the context or the whole pool."""
        return min(self.config.max_model_len, self.kv.num_usable_blocks * self.block_size)

    def add_request(self, request: Request) -> None:
        """Queue a request.  Raises ValueError if it could never fit (so it is rejected
        at admission instead of being preempted forever)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        need = request.num_prompt_tokens + request.max_tokens
        if need > self.max_tokens_per_request():
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_tokens}) needs {need} tokens, more than the "
                f"{self.max_tokens_per_request()} one request can hold")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (abort) requests wherever they are; unknown ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)

    # -- scheduling ----------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._num_preemptions_step += 1
        self.total_preemptions += 1
        self._finished_ids.add(victim.request_id)  # the runner drops its row
        self.waiting.add_preempted(victim)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running)  # lowest priority, then latest arrival
        return self.running[-1]  # newest

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        self._num_preemptions_step = 0
        preempted_ids: set[str] = set()

        # 1. Running requests, oldest first.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                # Budget granted to a victim earlier in this loop is given back.
                budget += num_scheduled.pop(victim.request_id, 0)
                cached = [c for c in cached if c.req_id != victim.request_id]
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                continue
            num_scheduled[req.request_id] = n
            cached.append(CachedRequestData(req.request_id, [b.block_id for b in blocks],
                                            req.num_computed_tokens))
            budget -= n

        # 2. Waiting requests (not in a step that had to preempt: memory is tight).
        now = time.time()
        while (not preempted_ids and budget > 0 and len(self.waiting) > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            blocks = self.kv.allocate_slots(req, n, hits)
            if blocks is None:
                break
            self.waiting.pop()
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            new.append(NewRequestData(
                req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                req.sampling_params, req.eos_token_id,
                self.kv.get_block_ids(req.request_id), num_hit))
            budget -= n

        # 3. Advance: these tokens will be computed by the time anyone looks again.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        finished = self._finished_ids
        self._finished_ids = set()
        return SchedulerOutput(
            new_reqs=new, cached_reqs=cached, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished, preempted_req_ids=preempted_ids)

    # -- results -------------------------------------------------------------------
    def _check_stop(self, req: Request, token: int) -> bool:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in (sp.stop_token_ids or ()):
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if (req.num_output_tokens >= req.max_tokens
                or req.num_tokens >= self.config.max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop rules, free finished requests' blocks."""
        outputs: list[EngineCoreOutput] = []
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            prompt_lp = out.prompt_logprobs.get(rid)
            if not tokens and prompt_lp is None:
                continue  # a prompt chunk: nothing to report yet
            new_tokens: list[int] = []
            stopped = False
            for t in tokens:  # one token per step today (more with speculative decoding)
                req.append_output_token_ids([t])
                new_tokens.append(t)
                if self._check_stop(req, t):
                    stopped = True
                    break
            lp = out.logprobs.get(rid)
            eo = EngineCoreOutput(
                request_id=rid, new_token_ids=new_tokens,
                new_logprobs=LogprobsLists([lp[0]], [lp[1]], [lp[2]]) if lp else None,
                new_prompt_logprobs=(LogprobsLists(prompt_lp.token_ids, prompt_lp.logprobs,
                                                   prompt_lp.ranks) if prompt_lp else None),
                num_cached_tokens=max(req.num_cached_tokens, 0))
            if not req._first_scheduled_reported:
                eo.first_scheduled_time = req.first_scheduled_time
                req._first_scheduled_reported = True
            if stopped:
                eo.finish_reason = RequestStatus.finish_reason(req.status)
                eo.stop_reason = req.stop_reason
                self.running.remove(req)
                self._free(req)
            outputs.append(eo)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(),
                                 timestamp=time.time())

    # -- introspection -------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        q, h = self.kv.take_prefix_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage(), num_preemptions=self._num_preemptions_step,
            prefix_cache_queries=q, prefix_cache_hits=h,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_usable_blocks)
