"""The runner's M-RoPE positions: three rows per token for models that declare
``uses_mrope`` (Qwen2-VL, Qwen2.5-VL; ``layers/mrope.py``).

```
 request with images, first scheduled:  model.get_mrope_input_positions(prompt, images)
                                          -> prompt rows [3, P] and delta (kept here)
 a step:   flat positions p (input_batch.py), every row      -> [3, T]
           image requests' prompt tokens  p < P               <- prompt rows[:, p]
           their later tokens             p >= P               <- p + delta
```

Computed once per request (kept across recompute preemption; a fork shares its
parent's), so a step costs one dict lookup per scheduled request and a slice copy per
image request -- never a loop over tokens.  Text-only requests need nothing: their three
rows equal the flat positions.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from pagedllm.core.outputs import SchedulerOutput


class MRopePositions:
    """Prompt position rows and deltas of the batch's image requests."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.prompt: dict[str, np.ndarray] = {}  # req id -> [3, P] int64
        self.delta: dict[str, int] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Apply the step's diffs: forks, departures (a preempted request keeps its
        rows), new image requests."""
        for f in sched.forks:
            if f.parent_req_id in self.prompt:
                self.prompt[f.child_req_id] = self.prompt[f.parent_req_id]
                self.delta[f.child_req_id] = self.delta[f.parent_req_id]
        for rid in sched.finished_req_ids:
            if rid not in sched.preempted_req_ids:
                self.prompt.pop(rid, None)
                self.delta.pop(rid, None)
        for nr in sched.new_reqs:
            if nr.mm_features and nr.req_id not in self.prompt:
                pos, delta = self.model.get_mrope_input_positions(  # type: ignore[operator]
                    nr.prompt_token_ids, nr.mm_features)
                self.prompt[nr.req_id], self.delta[nr.req_id] = pos, delta

    def positions(self, order: list[str], num_computed: np.ndarray, num_new: np.ndarray,
                  query_start_loc: np.ndarray, flat: np.ndarray) -> np.ndarray:
        """The step's ``[3, T]`` positions from its flat ones (scheduled order)."""
        out = np.repeat(flat[None], 3, axis=0)
        if not self.prompt:
            return out
        prompt = self.prompt
        for i in [i for i, r in enumerate(order) if r in prompt]:
            rows, delta = prompt[order[i]], self.delta[order[i]]
            start, n, q0 = int(num_computed[i]), int(num_new[i]), int(query_start_loc[i])
            plen = rows.shape[1]
            k = max(0, min(start + n, plen) - start)  # tokens inside the prompt
            if k:
                out[:, q0:q0 + k] = rows[:, start:start + k]
            if k < n:
                out[:, q0 + k:q0 + n] += delta
        return out
