"""The scheduler's side of speculative decoding (torch-free): drafts are scheduled
tokens, rejected ones are rolled back by the computed-token count.

```
 before step:  tokens [... t_last] + drafts [d1 d2 d3 d4]       num_computed = T - 1
 scheduled:    t_last d1 d2 d3 d4   (5 tokens under the budget) num_computed = T + 4
 verified:     d1 d2 accepted, x emitted at d3's place
 after:        tokens [... t_last d1 d2 x]                      num_computed = T + 2
               (= T + 4 - rejected 2; the slots of d3, d4 hold stale KV that the next
               step overwrites -- the KV manager keeps the blocks, nothing is copied)
```

Blocks holding drafts are never hashed into the prefix cache: the KV manager caches
only blocks full of a request's *known* tokens (``all_token_ids``), and drafts never
enter that list until accepted.

How many drafts a step carries is the per-step policy's (``spec_decode/policy.py``):
each ``schedule`` asks it for this step's k' (0..k, from the measured step-cost curve and
the acceptance seen so far) and for how many drafts the runner should propose after the
step (``SchedulerOutput.num_spec_proposals``); ``end_step`` feeds it what the step
showed (acceptance per position, and the step's wall time from its ``schedule`` to its
output: a loop period, whether the step ran synchronously -- while proposals are wanted
-- or, for n-gram with the policy off, under async scheduling).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from pagedllm.request import Request
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.policy import SpecPolicy, StepCostCurve

logger = logging.getLogger("pagedllm")


class SpecScheduling:
    def __init__(self, config: SpeculativeConfig, curve: StepCostCurve | None = None
                 ) -> None:
        """``curve``: the target's measured step cost (None: flat, acceptance alone
        decides; a scheduler without a runner)."""
        self.config = config
        k = config.num_speculative_tokens
        self.policy = SpecPolicy(k, curve, config.disable_by_batch_size)
        if curve is not None:  # an engine's scheduler (not a unit test's)
            logger.info("speculative decoding (%s, k=%d): %s", config.method, k,
                        self.policy.describe())
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * k
        # This step's verification, per position (tried, accepted): the policy's input.
        self._tries = [0] * k
        self._hits = [0] * k
        # When each step in flight was scheduled (perf_counter), oldest first: with async
        # scheduling step N + 1 is planned before step N's output is taken.
        self._t0: deque[float] = deque()
        self._last_end: float | None = None  # when the last step's output was taken
        # The last step verified no drafts and proposed none: the next plain step runs
        # in the loop's steady state (under async scheduling, overlapped), so it is timed.
        self._prev_plain = False
        # Totals since start (for benchmarks and tests; the metrics read take_stats).
        self.total_draft_tokens = self.total_accepted_tokens = self.total_drafts = 0
        self.total_steps = self.total_spec_steps = 0  # decode steps / those with drafts
        # The last plan asked the runner for proposals (the next step needs them).
        self._proposing = True
        # This update's proposal round: requests asked for drafts, and given some.
        self._asked = self._got = 0

    def plan(self, running: Sequence[Request]) -> tuple[int, int]:
        """(drafts per request this step, drafts per request to propose for the next):
        the policy's decision for the ``running`` requests and the drafts they hold."""
        self._t0.append(time.perf_counter())
        k = self.config.num_speculative_tokens
        hist = [0] * (k + 1)
        for r in running:  # over requests, not tokens
            hist[min(len(r.spec_token_ids), k)] += 1
        k_now, k_next = self.policy.plan(len(running), hist)
        self._proposing = k_next > 0
        return k_now, k_next

    def needs_sync(self, running: Sequence[Request]) -> bool:
        """Whether the next step must wait for this one's tokens (async scheduling pauses).

        A proposer drafts from a step's emitted tokens, so the step after one that
        proposes runs synchronously; while the policy has speculation off (no proposals)
        nothing needs them and an n-gram engine keeps async scheduling, so a large batch
        pays nothing for speculation being enabled.  Draft models and EAGLE heads follow
        the target every step (their KV), so they always run synchronously, as do
        seeded requests (they propose and verify every step: ``take``)."""
        if self.config.method != "ngram" or self._proposing:
            return True
        return any(r.sampling_params.seed is not None or r.spec_token_ids
                   for r in running)

    @staticmethod
    def take(req: Request, n: int, budget: int, cap: int) -> list[int]:
        """The drafts ``req`` verifies this step (they ride along its one decode token,
        at most ``cap``, cut to the budget); clears them from the request either way.

        A seeded request verifies every draft it has, whatever ``cap``: its random draws
        depend on the drafts it verifies (``rejection_sampler.py``), so its output must
        not depend on the policy's state or the batch (the runner proposes for it
        always: ``worker/spec_decode/runner.py``, ``SpecDecodeRunner.propose``)."""
        drafts = req.spec_token_ids
        if not drafts:
            return drafts
        req.spec_token_ids = []
        if req.sampling_params.seed is not None:
            cap = len(drafts)
        if cap <= 0 or n != 1 or budget < 2:
            return []
        return drafts[:min(cap, budget - 1)]

    def rollback(self, req: Request, drafts: list[int], num_emitted: int) -> None:
        """``num_emitted`` tokens came back for ``len(drafts)`` drafts: forget the KV of
        the rejected ones (``num_emitted - 1`` drafts were accepted)."""
        accepted = num_emitted - 1 if num_emitted else 0
        req.num_computed_tokens -= len(drafts) - accepted
        self._drafts += 1
        self._draft_tokens += len(drafts)
        self._accepted += accepted
        self.total_drafts += 1
        self.total_draft_tokens += len(drafts)
        self.total_accepted_tokens += accepted
        for i in range(accepted):  # <= k
            self._per_pos[i] += 1
            self._hits[i] += 1
        for i in range(min(accepted + 1, len(drafts))):  # positions verified
            self._tries[i] += 1

    def on_result(self, req: Request, tokens: list[int], drafts: list[int] | None,
                  next_drafts: list[int] | None, asked: bool) -> None:
        """``Scheduler.update_from_output``, for one request: ``tokens`` came back for
        the ``drafts`` it verified (the rejected ones are rolled back) and the runner
        proposed ``next_drafts`` for it; ``asked``: proposals were asked for in this
        step while it ran (the round ``end_update`` reports)."""
        if drafts:
            self.rollback(req, drafts, len(tokens))
        req.spec_token_ids = next_drafts or []
        if asked and tokens:
            self._asked += 1
            self._got += bool(req.spec_token_ids)

    def end_update(self, num_reqs: int, num_tokens: int, num_drafts: int,
                   proposed: bool) -> tuple[int, int, int, list[int]]:
        """After ``update_from_output``'s ``on_result`` calls: feed the policy the
        proposal round and the step (``end_step``); the stats since the last call
        (``take_stats``)."""
        self.observe_proposals(self._asked, self._got)
        self._asked = self._got = 0
        self.end_step(num_reqs, num_tokens, num_drafts, proposed)
        return self.take_stats()

    def observe_proposals(self, asked: int, got: int) -> None:
        """A step's proposal round: ``got`` of the ``asked`` requests received drafts."""
        if asked:
            self.policy.observe_proposals(asked, got)

    def end_step(self, num_reqs: int, num_tokens: int, num_drafts: int,
                 proposed: bool) -> None:
        """After ``update_from_output``: give the policy the step's acceptance and, for
        a decode-only step (``num_tokens == num_reqs + num_drafts``), its wall time --
        as a speculating step's if it verified drafts and proposed more (``proposed``:
        what steady speculation costs), as a plain step's if it did neither and the step
        before did neither either (a plain step right after a synchronous one is not
        what plain decoding costs under async scheduling)."""
        if num_drafts:
            self.policy.observe(self._tries, self._hits)
            k = self.config.num_speculative_tokens
            self._tries, self._hits = [0] * k, [0] * k
        t0 = self._t0.popleft() if self._t0 else None
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        plain, prev_plain = not num_drafts and not proposed, self._prev_plain
        self._prev_plain = plain
        if num_reqs and num_tokens == num_reqs + num_drafts and t0 is not None:
            self.total_steps += 1
            self.total_spec_steps += num_drafts > 0
            # Not a step of switching on or off; a plain one in steady state.
            if (num_drafts > 0) == proposed and (prev_plain or not plain):
                self.policy.observe_time(1000 * _period(t0, last, now), num_reqs,
                                         num_tokens, proposed)

    def take_stats(self) -> tuple[int, int, int, list[int]]:
        """(drafts, draft tokens, accepted tokens, accepted per position) since last call."""
        s = (self._drafts, self._draft_tokens, self._accepted, self._per_pos)
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * self.config.num_speculative_tokens
        return s


def _period(t0: float, last: float | None, now: float) -> float:
    """The wall time a step costs the loop, comparable between the two ways it runs:
    scheduled after the previous step's output was taken (synchronous: from the end of
    that step, i.e. its own schedule, launch and wait plus the loop's work in between;
    an idle gap longer than the step is left out), or while it was still in flight
    (async scheduling: the period between two outputs, as the steps overlap)."""
    if last is None:
        return now - t0
    if t0 >= last:
        gap = t0 - last
        return now - t0 + (gap if gap <= now - t0 else 0.0)
    return now - last
