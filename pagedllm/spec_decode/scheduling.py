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
enter that list until accepted.  A step only carries drafts while ``running`` is at most
``disable_by_batch_size`` (the per-step policy: large batches are compute-bound, where a
rejected draft is paid for in full).
"""

from __future__ import annotations

from pagedllm.request import Request
from pagedllm.spec_decode.config import SpeculativeConfig


class SpecScheduling:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * config.num_speculative_tokens
        # Totals since start (for benchmarks and tests; the metrics read take_stats).
        self.total_draft_tokens = self.total_accepted_tokens = self.total_drafts = 0

    def step_enabled(self, num_running: int) -> bool:
        """The per-step policy: drafts only while the batch is small."""
        return num_running <= self.config.disable_by_batch_size

    @staticmethod
    def take(req: Request, n: int, budget: int, enabled: bool) -> list[int]:
        """The drafts ``req`` verifies this step (they ride along its one decode token,
        cut to the budget); clears them from the request either way."""
        drafts = req.spec_token_ids
        if not drafts:
            return drafts
        req.spec_token_ids = []
        if not enabled or n != 1 or budget < 2:
            return []
        return drafts[:budget - 1]

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

    def take_stats(self) -> tuple[int, int, int, list[int]]:
        """(drafts, draft tokens, accepted tokens, accepted per position) since last call."""
        s = (self._drafts, self._draft_tokens, self._accepted, self._per_pos)
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * self.config.num_speculative_tokens
        return s
