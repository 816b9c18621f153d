"""The scheduler's side of images: which encoder inputs run each step, under a budget.

A request's images are placeholder runs in its prompt (``Request.mm_features``).  The
model runner encodes an image once (``worker/encoder_cache.py``) and scatters its rows
into every step whose chunk covers part of the run, so the scheduler only decides *when*
each image is encoded: in the first step whose chunk meets its run.  Encoder work per
step is bounded like prefill tokens (vLLM's ``max_num_encoder_input_tokens``)::

  budget 40, chunk of 64 tokens:   [ t t t | <img A: 30> | <img B: 30> | t t ]
                                            encode A (10 left) ^ B does not fit:
                                            the chunk is cut at B's start

An image larger than the whole budget is still encoded -- alone, in a step that has
encoded nothing else -- so every request makes progress; chunked prefill then splits
its placeholder run across steps, and the later chunks read the cached encoder output.
A preempted or finished request forgets what it encoded (the runner drops its
references then), so a recomputed request encodes again (or hits another's cache).

**Whole runs** (``whole_runs``: a model whose image tokens attend to their whole run,
``models/gemma3_mm.py``, ``SchedulerConfig.whole_placeholder_runs``): a chunk never ends
inside a placeholder run, since a query of the run reads keys up to the run's end and
those must be written in the step it runs.  A chunk that would is cut at the run's start
(or, starting inside the run -- a prefix-cache hit ending mid-run -- gets nothing until
a step has budget for the rest of the run)::

  budget 16:   [ t t t t | <img: 20 tokens> | t ]   ->  this step: the 4 text tokens;
                                                         the next: the image whole (20)

The engine refuses ``max_num_batched_tokens`` below such a model's run length, so every
run fits some step.  A prefix hit that ends inside a run is correct: a block's hash
covers the image's identifier, so it is reused only with the same image at the same
place, and its keys were computed with the whole run, as this request's would be.
"""

from __future__ import annotations

from pagedllm.multimodal.inputs import overlapping
from pagedllm.request import Request


class EncoderBudget:
    """Per step: ``begin``, then ``fit`` for every request granted tokens (in the order
    granted), then ``take`` for the output.  ``forget`` when a request is preempted,
    finished or aborted."""

    def __init__(self, max_tokens_per_step: int, whole_runs: bool = False) -> None:
        self.max_tokens = max_tokens_per_step
        self.whole_runs = whole_runs  # never end a chunk inside a run (module doc)
        self.left = max_tokens_per_step
        # req_id -> indices of its features encoded since it was (re)admitted.
        self.encoded: dict[str, set[int]] = {}
        self.scheduled: dict[str, list[int]] = {}
        self.free: dict[str, list[int]] = {}

    def begin(self) -> None:
        self.left = self.max_tokens
        self.scheduled, self.free = {}, {}

    def fit(self, req: Request, start: int, n: int) -> int:
        """How many of the ``n`` tokens from position ``start`` on the request may
        compute this step: ``n``, or less when an image the chunk starts does not fit
        the budget left, or with ``whole_runs`` when the chunk would end inside a run
        (then cut at that image's start; 0: not this step).  Records nothing: ``commit``
        does, once the grant is final."""
        feats = req.mm_features
        if not feats or n <= 0:
            return n
        done = self.encoded.get(req.request_id, ())
        need = 0
        end = start + n
        for i, f in overlapping(feats, start, end):
            if self.whole_runs and f.end > end:
                return max(0, f.offset - start)
            if i in done:
                continue
            # Alone in an untouched budget, any image fits (progress).
            fits = need + f.length <= self.left or (self.left == self.max_tokens
                                                    and need == 0)
            if not fits:
                return max(0, f.offset - start)
            need += f.length
        return n

    def commit(self, req: Request, start: int, n: int) -> None:
        """``req`` computes tokens ``[start, start + n)`` this step (``fit`` allowed
        them): schedule the encoder inputs its chunk starts, free those it finishes."""
        feats = req.mm_features
        if not feats or n <= 0:
            return
        rid = req.request_id
        end = start + n
        done = self.encoded.setdefault(rid, set())
        for i, f in overlapping(feats, start, end):
            if i not in done:
                done.add(i)
                self.scheduled.setdefault(rid, []).append(i)
                self.left -= f.length
            if f.end <= end:
                self.free.setdefault(rid, []).append(i)

    def forget(self, request_id: str) -> None:
        """The runner dropped the request's encoder outputs (preempted, finished)."""
        self.encoded.pop(request_id, None)
        self.scheduled.pop(request_id, None)
        self.free.pop(request_id, None)

    def take(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """This step's (encoder inputs to run, encoder outputs to release)."""
        return self.scheduled, self.free
