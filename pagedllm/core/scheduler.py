"""The phase-less token-budget scheduler.

Each step has a budget of ``max_num_batched_tokens``.  Every request wants
``num_tokens - num_computed_tokens`` more tokens computed: a whole prompt, the rest of
a prompt (chunked prefill), or one token (decode).  ``schedule`` grants them in order:

```
 budget ──► 1. running requests (oldest first; decodes and unfinished prompt chunks)
        │        no blocks left?  preempt the lowest-priority / newest running request
        │        (recompute: free its blocks, reset num_computed_tokens, back to waiting;
        │        or swap it out)
        ├─► 2. swapped-out requests come back      ┐ while budget, blocks and
        └─► 3. waiting requests (FCFS, priority    │ max_num_seqs allow -- skipped
               or throughput)                      ┘ in a step that had to preempt
            4. nothing scheduled but requests wait: break a beam deadlock
            5. advance the scheduled requests; 6. fork n > 1 parents -> SchedulerOutput
```

The throughput policy (offline batches; ``LLM``'s default on CUDA) changes two things
only, and only for requests whose length is known (no EOS, stop token or stop string can
end them early): the waiting order (longest ``max_tokens`` first) and how many prompt
tokens a step may compute while requests wait (prefill paced over the decode horizon:
``core/prefill_pacing.py``).  Other requests go first and are never delayed.

A prompt longer than the remaining budget is cut into a chunk; the rest comes next step,
mixed with other requests' decode tokens.  Work per step is O(number of requests): no
loop here ever runs over a request's tokens (block hashing is incremental and amortised).

Memory sharing stays phase-less too (docs/memory_sharing.md):

* **n > 1 samples**: the request computes its prompt up to the last token, then forks
  into n sequences that share its blocks; each computes the last prompt token itself
  (sample i seeded with ``seed + i``) and the shared partial block is copied on write.
* **beam search** (``core/beam_search.py``): beams are ordinary requests reporting their
  top-K next tokens; when all have reported, the group forks/keeps/drops beams.
* **swap preemption** (``core/swap.py``): a victim's computed blocks are copied to CPU
  blocks and come back, to fresh GPU blocks, before it runs again (swapped requests
  resume before new ones); at most ``max_swap_blocks_per_step`` blocks move per step (one
  request always may).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.beam_search import BeamSearchCoordinator
from pagedllm.core.encoder_budget import EncoderBudget
from pagedllm.core.hybrid_kv_cache_manager import make_kv_cache_manager
from pagedllm.core.lora_budget import LoRABudget
from pagedllm.core.offload_tier import make_offload_tier
from pagedllm.core.outputs import (
    CachedRequestData,
    ForkRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.prefill_pacing import prefill_cap_for
from pagedllm.core.request_queue import LongestFirstQueue, make_queue
from pagedllm.core.swap import SwapManager
from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
)
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams, child_seed
from pagedllm.spec_decode.policy import StepCostCurve
from pagedllm.spec_decode.scheduling import SpecScheduling

logger = logging.getLogger("pagedllm")


def _needs_sync(req: Request) -> bool:
    """Whether ``req`` keeps the engine synchronous (see ``Scheduler.requires_sync``):
    it still has to fork, asked for prompt logprobs, uses penalties, or reads its
    output while sampling (bad words, logits processors)."""
    sp = req.sampling_params
    return bool(req.fork_ids or sp.prompt_logprobs is not None or sp.presence_penalty
                or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or sp.needs_output_tokens)


@dataclass(slots=True)
class _Step:
    """One step's decisions while ``Scheduler.schedule`` makes them (its output to be).

    ``budget`` is the tokens still to grant; ``in_flight`` / ``max_reqs`` the pipeline
    limits (``schedule``'s arguments); ``prefill_cap`` the prompt tokens the throughput
    policy still allows (None: no cap); ``spec_cap`` the drafts a request may verify and
    ``spec_next`` the proposals the runner makes after the step; ``forks`` the forks
    decided since the last step; ``touched`` the requests scheduled, in order.
    """

    budget: int
    in_flight: AbstractSet[str]
    max_reqs: int
    prefill_cap: int | None
    spec_cap: int
    spec_next: int
    forks: list[ForkRequestData]
    num_scheduled: dict[str, int] = field(default_factory=dict)
    cached: list[CachedRequestData] = field(default_factory=list)
    cow_copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    new: list[NewRequestData] = field(default_factory=list)
    touched: list[Request] = field(default_factory=list)
    preempted_ids: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def take_back(self, victim_id: str) -> int:
        """Record ``victim_id`` as preempted and withdraw what this step granted it
        (lists are changed in place); the tokens given back to the budget."""
        self.preempted_ids.add(victim_id)
        self.spec_tokens.pop(victim_id, None)
        self.cached[:] = [c for c in self.cached if c.req_id != victim_id]
        self.cow_copies.pop(victim_id, None)
        return self.num_scheduled.pop(victim_id, 0)


class Scheduler:
    """Owns every unfinished request and the waiting and running queues; swapped-out
    requests are kept by ``swap`` (core/swap.py), beam search groups by ``beams``
    (core/beam_search.py).

    ``num_cpu_blocks`` is the size of the swap space (``preemption_mode="swap"``); its
    block ids index the runner's CPU KV tensors.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, num_cpu_blocks: int = 0,
                 fill_step_sizes: Sequence[int] = (),
                 step_cost: StepCostCurve | None = None) -> None:
        self.config = scheduler_config
        # Token counts the throughput policy fills a mixed step up to: the runner's chunk
        # CUDA graph sizes on or near their cost curve's convex hull (a step pads up to
        # its graph anyway, so prompt tokens in that padding cost nothing extra:
        # ``core/prefill_pacing.py``).
        self._step_sizes = sorted(fill_step_sizes)
        self._max_model_len = scheduler_config.max_model_len  # read per request per step
        self.block_size = cache_config.block_size
        # One block table per KV cache group: several for a model mixing sliding and
        # full attention layers (core/hybrid_kv_cache_manager.py).
        self.kv = make_kv_cache_manager(
            num_blocks, cache_config.block_size,
            getattr(cache_config, "kv_cache_groups", None),
            cache_config.enable_prefix_caching, getattr(cache_config, "sliding_window", None),
            scheduler_config.max_num_batched_tokens)
        self._max_tokens_per_request = self._most_tokens_that_fit()
        self.requests: dict[str, Request] = {}
        # The live requests whose sampling parameters may make ``requires_sync`` true,
        # so that it need not look at every request every step (usually none).
        self._may_need_sync: dict[str, Request] = {}
        self.waiting = make_queue(scheduler_config.policy)
        # The throughput policy's queue, which paces prefill (None under fcfs/priority).
        self._lpt = self.waiting if isinstance(self.waiting, LongestFirstQueue) else None
        self.running: list[Request] = []
        # Swap preemption: the swapped-out requests and the CPU blocks holding their KV.
        self.swap = SwapManager(self.kv, num_cpu_blocks,
                                scheduler_config.preemption_mode == "swap",
                                scheduler_config.max_swap_blocks_per_step)
        # The prefix cache's host tier (``kv_offload_bytes``; None when off): evicted
        # cached blocks go to host memory and come back on a hit (core/offload_tier.py),
        # with a disk tier behind it (``kv_offload_disk_bytes``, core/disk_tier.py).
        self.offload = make_offload_tier(
            self.kv, getattr(cache_config, "num_offload_blocks", 0)
            if cache_config.enable_prefix_caching else 0,
            getattr(cache_config, "num_offload_disk_blocks", 0))
        self._offload_block_bytes = getattr(cache_config, "kv_offload_block_bytes", 0)
        # Images: when each is encoded, under the encoder budget (core/encoder_budget.py).
        self.encoder = EncoderBudget(
            getattr(scheduler_config, "max_num_encoder_input_tokens", 0)
            or scheduler_config.max_num_batched_tokens,
            getattr(scheduler_config, "whole_placeholder_runs", False))
        # Beam search: groups of beams that advance together (hooks below).
        self.beams = BeamSearchCoordinator(self.requests, self._fork, self._drop,
                                           self._release_reserved)
        # Sequences running requests will still fork into (reserved under max_num_seqs).
        self._reserved = 0
        # Forks decided since the last SchedulerOutput (emitted with the next one).
        self._pending_forks: list[ForkRequestData] = []
        # Requests the runner must drop at the next step.
        self._finished_ids: set[str] = set()
        self._num_preemptions_step = 0
        self.total_preemptions = 0
        self.peak_num_running = 0  # the most requests running at once (benchmarks)
        # Speculative decoding: drafts are scheduled tokens (spec_decode/scheduling.py).
        spec = getattr(scheduler_config, "speculative_config", None)
        self.spec = SpecScheduling(spec, step_cost) if spec is not None else None

    # -- admission -----------------------------------------------------------------
    def max_tokens_per_request(self) -> int:
        """The most tokens one request may ever hold: the context or the whole pool."""
        return self._max_tokens_per_request

    def _most_tokens_that_fit(self) -> int:
        """The largest length up to max_model_len whose blocks (all groups) fit the pool."""
        lo, hi = 0, self.config.max_model_len
        usable = self.kv.num_usable_blocks
        while lo < hi:  # binary search: blocks_needed grows with the length
            mid = (lo + hi + 1) // 2
            if self.kv.blocks_needed(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add_request(self, request: Request) -> None:
        """Queue a request.  Raises ValueError if it could never fit (so it is rejected
        at admission instead of being preempted forever)."""
        rid = request.request_id
        for i in [rid, *request.fork_ids]:
            if i in self.requests or i in self.beams.groups:
                raise ValueError(f"request_id {i!r} is already in use")
        need = request.num_prompt_tokens + request.max_tokens
        if need > self.max_tokens_per_request():
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_tokens}) needs {need} tokens, more than the "
                f"{self.max_tokens_per_request()} one request can hold")
        beam_search = request.sampling_params.use_beam_search
        width = self.beams.width(request, self.kv.blocks_needed(need),
                                 self.kv.num_usable_blocks) if beam_search \
            else 1 + len(request.fork_ids)
        if width > self.config.max_num_seqs:
            raise ValueError(f"n ({width} sequences) exceeds max_num_seqs "
                             f"({self.config.max_num_seqs})")
        if beam_search:
            self.beams.start(request, width)
        self._track(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (abort) requests wherever they are; unknown ids are ignored.  A beam
        search request's id aborts all its beams."""
        for rid in request_ids:
            if self.beams.abort(rid, status):
                continue
            req = self.requests.get(rid)
            if req is not None:
                self._drop(req, status)

    def _drop(self, req: Request, status: RequestStatus) -> None:
        """Take ``req`` out of whichever queue holds it and free everything it holds."""
        if req.status == RequestStatus.RUNNING:
            self._remove_running(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swap.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self._free(req)

    def _track(self, req: Request) -> None:
        """Register a live request (see ``requires_sync`` for ``_may_need_sync``)."""
        self.requests[req.request_id] = req
        if _needs_sync(req):
            self._may_need_sync[req.request_id] = req

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.offload is not None:
            self.offload.forget(req.request_id)
        self.encoder.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self._may_need_sync.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)

    def _add_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._reserved += req.reserved_slots

    def _remove_running(self, req: Request) -> None:
        self.running.remove(req)
        self._reserved -= req.reserved_slots

    def _release_reserved(self, req: Request) -> None:
        """``req`` will fork into no more sequences: its reserved seats are free."""
        if req.status == RequestStatus.RUNNING:
            self._reserved -= req.reserved_slots
        req.reserved_slots = 0

    def _has_seat(self, req: Request) -> bool:
        return (len(self.running) + self._reserved + 1 + req.reserved_slots
                <= self.config.max_num_seqs)

    # -- preemption ----------------------------------------------------------------
    def _preempt(self, victim: Request, to_back: bool = False) -> None:
        self._remove_running(victim)
        victim.num_preemptions += 1
        victim.token_override = None  # the runner rebuilds its row from our tokens
        victim.num_placeholders = 0  # an in-flight token still arrives: see update
        victim.spec_token_ids = []
        self._num_preemptions_step += 1
        self.total_preemptions += 1
        self._finished_ids.add(victim.request_id)  # the runner drops its row
        self.encoder.forget(victim.request_id)  # and its encoder outputs
        if self.swap.park(victim):  # swap preemption, when its budget allows
            return
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        if to_back:
            self.waiting.add(victim)
        else:
            self.waiting.add_preempted(victim)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running)  # lowest priority, then latest arrival
        return self.running[-1]  # newest

    # -- forks ---------------------------------------------------------------------
    def _fork(self, parent: Request, child_id: str,
              params: SamplingParams | None = None) -> Request:
        """A new sequence with ``parent``'s tokens.  A running parent shares its blocks
        (the runner copies its row at the next step); any other parent holds no KV, so
        the child simply waits to be computed from scratch."""
        child = parent.fork(child_id, params)
        self._track(child)
        if parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            self._add_running(child)
            self._pending_forks.append(ForkRequestData(parent.request_id, child_id, params))
        else:
            child.status = RequestStatus.PREEMPTED
            self.waiting.add_preempted(child)
        return child

    def _fork_samples(self, parent: Request) -> None:
        """n > 1: the prompt is computed but for its last token; sample i (``fork_ids[i
        - 1]``) continues from here with ``seed + i`` (wrapped into int64: ``child_seed``)."""
        sp = parent.sampling_params
        for i, cid in enumerate(parent.fork_ids, 1):
            self._fork(parent, cid, sp.clone(
                n=1, seed=None if sp.seed is None else child_seed(sp.seed, i),
                prompt_logprobs=None))
        self._release_reserved(parent)  # running: schedule() forks running parents only
        parent.fork_ids = []

    def _num_to_compute(self, req: Request) -> int:
        p = req.num_placeholders
        if p and (req.num_output_tokens + p >= req.max_tokens
                  or req.num_tokens + p >= self._max_model_len):
            return 0  # the in-flight token is its last: nothing more to schedule
        n = req.num_tokens + p - req.num_computed_tokens
        # A parent of n > 1 samples stops one token short: each sample computes the last
        # prompt token itself, so each samples from its own row with its own seed.
        return n - 1 if req.fork_ids else n

    # -- scheduling ----------------------------------------------------------------
    def schedule(self, *, in_flight_req_ids: AbstractSet[str] = frozenset(),
                 max_num_scheduled_reqs: int = 0) -> SchedulerOutput:
        """Decide one step: how many tokens each running and waiting request computes.

        Pipeline parallelism (the engine core passes both for each batch it launches):
        at most ``max_num_scheduled_reqs`` requests, so that the live requests spread
        over the stages' micro-batches, and none of ``in_flight_req_ids`` (the requests
        of batches still in flight, left out until their output is back).  The defaults
        (0: no limit, and the ids are then ignored) schedule every request that fits.
        """
        self._num_preemptions_step = 0
        self.swap.begin_step()
        self.encoder.begin()
        # Speculative decoding: this step's drafts per request (the per-step policy),
        # and how many the runner proposes after it (spec_decode/scheduling.py).
        spec_cap, spec_next = self.spec.plan(self.running) if self.spec is not None \
            else (0, 0)
        # Throughput policy: how many prompt tokens (running chunks and new requests)
        # this step may compute; None = no limit beyond the budget.
        prefill_cap = prefill_cap_for(self.running, self._lpt,
                                      self.config.max_num_batched_tokens,
                                      self._step_sizes) \
            if self._lpt is not None and len(self._lpt) else None
        step = _Step(budget=self.config.max_num_batched_tokens,
                     in_flight=in_flight_req_ids, max_reqs=max_num_scheduled_reqs,
                     prefill_cap=prefill_cap, spec_cap=spec_cap, spec_next=spec_next,
                     forks=self._pending_forks)
        self._pending_forks = []

        # 1. Running requests, oldest first; no blocks left: preempt.
        self._schedule_running(step)
        if not step.preempted_ids:  # memory is tight in a step that had to preempt
            now = time.time()
            # Multi-LoRA: admit no request whose adapter would exceed max_loras.
            loras = LoRABudget(self.config.max_loras, self.running)
            # 2. Swapped-out requests come back first (they are older than new arrivals).
            self._schedule_swapped(step, loras, now)
            # 3. Waiting requests (under the throughput policy: what the pace leaves).
            self._schedule_waiting(step, loras, now)

        # 4. Nothing runs although requests wait: beams waiting for group-mates that
        # cannot get in (a deadlock only beams cause).  Make room at the queue's back.
        if not step.touched:
            victim = self.beams.deadlock_victim(
                self.running, bool(len(self.waiting) or len(self.swap)))
            if victim is not None:
                self._preempt(victim, to_back=True)
                step.preempted_ids.add(victim.request_id)

        # 5. Advance: these tokens will be computed by the time anyone looks again; a
        # request whose known tokens are then all computed will sample one more (its
        # placeholder, until ``update_from_output`` reports the real token).
        requests = self.requests
        for rid, n in step.num_scheduled.items():
            r = requests[rid]
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens + r.num_placeholders:
                r.num_placeholders += 1
        # 6. n > 1 parents whose prompt is computed but for the last token fork now.
        for req in step.touched:
            if req.fork_ids and req.status == RequestStatus.RUNNING and \
                    req.num_computed_tokens >= req.num_tokens - 1:
                self._fork_samples(req)
        return self._output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Grant running requests, oldest first, their tokens (a decode token, the next
        prompt chunk, drafts to verify) while the budget lasts.  One that gets no blocks
        preempts the lowest-priority / newest running request (``_pick_victim``, perhaps
        itself) until it fits; what this step granted a victim is given back."""
        kv = self.kv
        spec = self.spec
        budget, prefill_cap, spec_cap = step.budget, step.prefill_cap, step.spec_cap
        num_scheduled, cached, cow_copies = step.num_scheduled, step.cached, step.cow_copies
        running_status = RequestStatus.RUNNING  # a local: read per request
        in_flight, max_reqs = step.in_flight, step.max_reqs
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != running_status:
                continue  # preempted as a victim earlier in this loop
            if max_reqs:  # pipeline parallelism (see schedule)
                if req.request_id in in_flight:
                    continue
                if len(num_scheduled) >= max_reqs:
                    break
            n = self._num_to_compute(req)
            if n > budget:
                n = budget
            if prefill_cap is not None and n > 1:  # a prompt chunk: paced
                n = min(n, prefill_cap)
                prefill_cap -= n
            if req.mm_features:  # cut at an image the encoder budget cannot take
                n = self.encoder.fit(req, req.num_computed_tokens, n)
            if n <= 0:
                continue  # a beam waiting for the rest of its group (or a paced chunk)
            drafts = SpecScheduling.take(req, n, budget, spec_cap) if spec else ()
            n += len(drafts)
            blocks = kv.allocate_slots(req, n)
            while blocks is None:
                victim = self._pick_victim()
                self._preempt(victim)
                # Budget granted to a victim earlier in this loop is given back.
                budget += step.take_back(victim.request_id)
                if victim is req:
                    break
                blocks = kv.allocate_slots(req, n)
            if blocks is None:
                continue
            rid = req.request_id
            num_scheduled[rid] = n
            if req.mm_features:
                self.encoder.commit(req, req.num_computed_tokens, n)
            if drafts:
                step.spec_tokens[rid] = drafts  # type: ignore[assignment]
            cow = kv.take_cow(rid)
            if cow:
                cow_copies[rid] = [(src, dst) for _, src, dst in cow]
            data = CachedRequestData(
                rid, [b.block_id for b in blocks] if blocks else [],
                req.num_computed_tokens, [(i, dst) for i, _, dst in cow] if cow else [],
                req.token_override)
            groups = kv.take_group_updates(rid)  # hybrid KV cache groups only
            if groups is not None:
                data.new_group_block_ids = groups.new_block_ids
                data.replaced_group_block_ids = groups.replaced
                if groups.copies:
                    cow_copies.setdefault(rid, []).extend(groups.copies)
            cached.append(data)
            req.token_override = None
            step.touched.append(req)
            budget -= n
        step.budget, step.prefill_cap = budget, prefill_cap

    def _schedule_swapped(self, step: _Step, loras: LoRABudget, now: float) -> None:
        """Resume swapped-out requests, oldest first, while the budget, seats, adapters
        and this step's swap budget allow (``SwapManager.resume``)."""
        swap = self.swap
        for req in list(swap.swapped):
            if step.budget <= 0 or not self._has_seat(req) or not loras.admits(req):
                break
            n = min(self._num_to_compute(req), step.budget)
            if req.mm_features:
                n = self.encoder.fit(req, req.num_computed_tokens, n)
            if n <= 0:
                continue  # a beam waiting for its group: stays parked
            if not swap.resume(req, n):
                break
            self.encoder.commit(req, req.num_computed_tokens, n)
            self._admit(req, n, step, now)
            step.budget -= n
            loras.add(req)

    def _schedule_waiting(self, step: _Step, loras: LoRABudget, now: float) -> None:
        """Admit waiting requests in queue order while the budget (under the throughput
        policy: what the prefill pace leaves), blocks and seats allow; prefix-cache hits
        count as computed, those the host tier loads back in this step too
        (core/offload_tier.py).  One whose adapter would exceed ``max_loras``, or of
        whose host-held prefix this step could load only part, is skipped this step and
        keeps its place."""
        budget = step.budget
        if step.prefill_cap is not None:
            budget = min(budget, step.prefill_cap)
        in_flight, max_reqs, num_scheduled = step.in_flight, step.max_reqs, step.num_scheduled
        waiting, kv = self.waiting, self.kv
        skipped: list[Request] = []
        while budget > 0 and len(waiting) > 0 and self._has_seat(waiting.peek()):
            req = waiting.peek()
            if max_reqs and (req.request_id in in_flight
                             or len(num_scheduled) >= max_reqs):
                break  # (preempted while its batch is in flight: wait for its token)
            if not loras.admits(req):
                skipped.append(waiting.pop())
                continue
            # Host-held blocks of its prefix come back to the device, loaded while this
            # step runs: the lookup below finds them as device hits.  Only part of them
            # (no room this step): it waits a step for the rest rather than recompute.
            if self.offload is not None and self.offload.promote(req):
                skipped.append(waiting.pop())
                continue
            hits, num_hit = kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit - (1 if req.fork_ids else 0), budget)
            if req.mm_features and n > 0:
                n = self.encoder.fit(req, num_hit, n)
                if n == 0:
                    break  # its next image waits for the next step's encoder budget
            if kv.allocate_slots(req, n, hits) is None:
                break
            waiting.pop()
            self.beams.on_recompute(req)
            if kv.enable_caching:
                kv.record_prefix_lookup(req.num_tokens, num_hit)
                if self.offload is not None:
                    self.offload.record_lookup(req)
            req.num_computed_tokens = num_hit
            self.encoder.commit(req, num_hit, n)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self._admit(req, n, step, now)
            budget -= n
            loras.add(req)
        for req in reversed(skipped):  # back to their places at the head
            waiting.add_preempted(req)
        step.budget = budget

    def _output(self, step: _Step) -> SchedulerOutput:
        """The step's decisions for the runner, with what changed since the last one."""
        finished, self._finished_ids = self._finished_ids, set()
        num_scheduled, cow_copies = step.num_scheduled, step.cow_copies
        kv_offload, kv_load = self.offload.take_copies() if self.offload is not None \
            else ([], [])
        disk_save, disk_load = self.offload.disk_copies if self.offload is not None \
            else ([], [])
        return SchedulerOutput(
            new_reqs=step.new, cached_reqs=step.cached, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished, preempted_req_ids=step.preempted_ids,
            forks=step.forks, swap_out=self.swap.swap_out, swap_in=self.swap.swap_in,
            kv_offload=kv_offload, kv_load=kv_load, kv_disk_save=disk_save,
            kv_disk_load=disk_load,
            block_copies=[p for c in step.cached for p in cow_copies.get(c.req_id, ())]
            if cow_copies else [], scheduled_spec_decode_tokens=step.spec_tokens,
            num_spec_proposals=step.spec_next,
            scheduled_encoder_inputs=self.encoder.scheduled,
            free_encoder_inputs=self.encoder.free)

    def _admit(self, req: Request, n: int, step: _Step, now: float) -> None:
        """Move a request that just got its blocks into ``running`` and tell the runner
        everything about it (a resumed one carries its generated tokens)."""
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.token_override = None
        self._add_running(req)
        if n > 0:  # n == 0: an n > 1 parent whose whole prompt but one token hit the cache
            step.num_scheduled[req.request_id] = n
        step.new.append(NewRequestData(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids),
            req.sampling_params, req.eos_token_id,
            self.kv.get_block_ids(req.request_id), req.num_computed_tokens,
            lora_request=req.lora_request,
            group_block_ids=self.kv.get_group_block_ids(req.request_id),
            mm_features=req.mm_features))
        step.touched.append(req)

    # -- results -------------------------------------------------------------------
    def _check_stop(self, req: Request, token: int) -> bool:
        """Stop rules for ``token``, just appended to ``req``; sets the finished status."""
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if token == req.eos_token_id and not sp.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if (req.num_output_tokens >= req.max_tokens
                or req.num_tokens >= self._max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop rules, free finished requests' blocks."""
        outputs: list[EngineCoreOutput] = []
        spec = self.spec
        proposals = sched.num_spec_proposals > 0  # speculative decoding: drafts asked for
        requests = self.requests
        running_status = RequestStatus.RUNNING
        # Most steps carry no logprobs at all: skip the per-request lookups then.
        all_lp = out.logprobs or None
        all_prompt_lp = out.prompt_logprobs or None
        for rid, why in out.failed.items():  # fail these requests only, never the step
            if rid in requests:
                logger.warning("request %s failed: %s", rid, why)
                outputs.append(EngineCoreOutput(request_id=rid, new_token_ids=[],
                                                finish_reason=FinishReason.ABORT))
                self.finish_requests([rid])
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted while the step ran
            was_running = req.status == running_status
            if was_running:
                if req.num_placeholders:
                    p = req.num_placeholders - len(tokens)
                    req.num_placeholders = p if p > 0 else 0
            elif not (req.status == RequestStatus.PREEMPTED and tokens):
                continue
            if spec is not None:  # roll back rejected drafts; take the next ones
                spec.on_result(req, tokens, sched.scheduled_spec_decode_tokens.get(rid),
                               out.spec_token_ids.get(rid), proposals and was_running)
            # (A request preempted while its step was in flight still takes that token:
            # it was sampled from the right state, and dropping it would change a
            # seeded request's output.)
            if req.beam_group is not None:  # the group chooses its beams' tokens
                self.beams.on_token(req, tokens, out.logprobs.get(rid))
                continue
            prompt_lp = all_prompt_lp.get(rid) if all_prompt_lp else None
            if not tokens and prompt_lp is None:
                continue  # a prompt chunk: nothing to report yet
            # One token per step today (more with speculative decoding, none for a
            # prompt-logprobs chunk); tokens after a stop are dropped.
            new_tokens = tokens
            stopped = False
            for i, t in enumerate(tokens):
                req.append_output_token_id(t)
                if self._check_stop(req, t):
                    stopped = True
                    new_tokens = tokens[:i + 1]
                    break
            lp = all_lp.get(rid) if all_lp else None
            eo = EngineCoreOutput(
                request_id=rid, new_token_ids=new_tokens,
                new_logprobs=LogprobsLists([lp[0]], [lp[1]], [lp[2]]) if lp else None,
                new_prompt_logprobs=(LogprobsLists(prompt_lp.token_ids, prompt_lp.logprobs,
                                                   prompt_lp.ranks) if prompt_lp else None),
                num_cached_tokens=req.num_cached_tokens if req.num_cached_tokens > 0 else 0)
            if not req._first_scheduled_reported:
                eo.first_scheduled_time = req.first_scheduled_time
                req._first_scheduled_reported = True
            if stopped:
                eo.finish_reason = RequestStatus.finish_reason(req.status)
                eo.stop_reason = req.stop_reason
                if was_running:
                    self._remove_running(req)
                else:
                    self.waiting.remove(req)
                self._free(req)
            outputs.append(eo)
        outputs.extend(self.beams.on_update())  # beam groups whose beams all reported
        stats = self.make_stats()
        stats.num_scheduled_tokens = sched.total_num_scheduled_tokens
        if spec is not None:
            (stats.spec_num_drafts, stats.spec_num_draft_tokens,
             stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos) = spec.end_update(
                len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens,
                sum(map(len, sched.scheduled_spec_decode_tokens.values())), proposals)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def requires_sync(self) -> bool:
        """True while some live request needs each step's tokens on the host before the
        next step is scheduled: penalties read the generated tokens, forks and beams
        rearrange sequences, prompt logprobs and swapping are synchronous.  Async
        scheduling pauses then.  (``min_tokens`` needs only the *count* of generated
        tokens, which the runner knows including the one in flight.)  Speculative
        decoding: while proposals are wanted (``SpecScheduling.needs_sync``)."""
        if self.beams.active or self.swap.enabled:
            return True
        if self.spec is not None and self.spec.needs_sync(self.running):
            return True
        # Candidates only: a request's parameters never change, and fork_ids only empties.
        return any(_needs_sync(r) for r in self._may_need_sync.values())

    # -- introspection -------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (both tiers); False (nothing done) while
        blocks are in use."""
        done = self.kv.pool.reset_prefix_cache()
        if done and self.offload is not None:
            self.offload.reset()
        return done

    def make_stats(self) -> SchedulerStats:
        if len(self.running) > self.peak_num_running:
            self.peak_num_running = len(self.running)
        q, h = self.kv.take_prefix_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.swap),
            kv_cache_usage=self.kv.usage(), num_preemptions=self._num_preemptions_step,
            prefix_cache_queries=q, prefix_cache_hits=h,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_usable_blocks)
        if self.offload is not None:
            self.offload.record_stats(stats, self._offload_block_bytes)
        return stats
