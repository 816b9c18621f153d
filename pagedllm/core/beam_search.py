"""Beam search bookkeeping for one request (torch-free): Hugging Face's algorithm.

The scheduler runs every live beam of a group as an ordinary request; each beam asks the
runner for the top-``K`` log probabilities of its next token (``K = 2 x beam width`` for one
stop token).  When every live beam has reported for the current length, ``advance`` picks
the next beams exactly as ``transformers`` ``generate(num_beams=k, do_sample=False)``
does (``early_stopping=False``):

```
 candidates  = top-K over all live beams of (beam score + logprob of token)
 finished   += candidates ranked < k that end in a stop token (or reach max_tokens),
               scored  sum_logprobs / generated_len ** length_penalty     (best k kept)
 live beams  = the best k candidates that did not finish
 done        when no live beam can still beat the worst of k finished hypotheses
             (best live score / len ** length_penalty <= worst finished score),
             or every candidate hit a stop condition
```

``BeamSearchCoordinator`` runs the groups inside the scheduler, through a few hooks the
scheduler calls (each does nothing while no beam search request is live).  It turns
``BeamStep.keep`` into block operations: the first new beam taken from a parent reuses
the parent's request, every further one forks it (sharing its KV blocks; the shared
partial block is copied on write when both append), and parents no one chose are freed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pagedllm.messages import EngineCoreOutput, FinishReason
from pagedllm.request import Request, RequestStatus


@dataclass
class BeamHypothesis:
    """A finished sequence: its generated tokens, length-penalised score and plain sum."""

    score: float
    token_ids: list[int]
    cumulative_logprob: float
    stopped: bool  # True: ended in a stop token; False: reached max_tokens


@dataclass
class BeamStep:
    """The outcome of one ``advance``: ``keep`` = (parent beam id, token, new cumulative
    logprob) for the next live beams, best first; ``done`` = the search is over."""

    keep: list[tuple[str, int, float]]
    done: bool


@dataclass
class BeamGroup:
    """One beam-search request.  ``output_ids`` are the ids the best ``len(output_ids)``
    hypotheses are reported under; beams themselves are internal requests."""

    group_id: str
    output_ids: list[str]
    beam_width: int
    max_tokens: int
    length_penalty: float
    stop_token_ids: frozenset[int]
    # beam request id -> cumulative logprob of its generated tokens; insertion = rank.
    live: dict[str, float] = field(default_factory=dict)
    pending: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    finished: list[BeamHypothesis] = field(default_factory=list)
    num_generated: int = 0
    improvable: bool = True  # HF's "early stop heuristic unsatisfied"
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def num_candidates(self) -> int:
        """K: how many next tokens each beam must report (HF's ``beams_to_keep``)."""
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width

    def new_beam_id(self) -> str:
        return f"{self.group_id}#beam{next(self._ids)}"

    def record(self, beam_id: str, token_ids: list[int], logprobs: list[float]) -> bool:
        """Store a beam's top-K next tokens; True once every live beam has reported."""
        self.pending[beam_id] = (token_ids, logprobs)
        return len(self.pending) >= len(self.live)

    def advance(self, generated: dict[str, list[int]]) -> BeamStep:
        """One beam step from the recorded candidates.  ``generated[b]`` is beam ``b``'s
        generated tokens so far (for finished hypotheses)."""
        k, big_k = self.beam_width, self.num_candidates
        cands: list[tuple[float, int, int, str]] = []
        for rank, (beam, score) in enumerate(self.live.items()):
            toks, lps = self.pending[beam]
            cands.extend((score + lp, rank, t, beam) for t, lp in zip(toks[:big_k], lps[:big_k]))
        # Best first; ties by beam rank then token id, like a topk over [beam, vocab].
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = cands[:big_k]
        gen_len = self.num_generated + 1
        hits = [t in self.stop_token_ids or gen_len >= self.max_tokens for _, _, t, _ in top]
        if self.improvable:
            for i, (score, _, t, beam) in enumerate(top[:k]):
                if hits[i]:
                    self.finished.append(BeamHypothesis(
                        score / gen_len ** self.length_penalty, generated[beam] + [t], score,
                        t in self.stop_token_ids))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier wins ties
            del self.finished[k:]
        keep = [(beam, t, score) for (score, _, t, beam), hit in zip(top, hits) if not hit][:k]
        self.num_generated = gen_len
        if self.improvable and len(self.finished) >= k and keep:
            best = keep[0][2] / gen_len ** self.length_penalty
            self.improvable = best > self.finished[-1].score
        self.pending.clear()
        return BeamStep(keep, done=not self.improvable or all(hits) or not keep)

    def results(self) -> list[BeamHypothesis]:
        """The finished hypotheses, best first (at most ``beam_width``)."""
        return list(self.finished)


class BeamSearchCoordinator:
    """Every live beam search group, and the scheduler's hooks into them.

    Beams are ordinary requests of the scheduler (``Request.beam_group`` names their
    group); the coordinator decides what happens to them between steps.  The scheduler
    calls, in its own order::

        add_request        width(root, ...), then start(root, width)
        finish_requests    abort(request_id, status)   -> True: the id named a group
        update_from_output on_token(beam, ...) per beam; then on_update() -> outputs
        schedule           on_recompute(req) per admitted waiting request;
                           deadlock_victim(running, anything_waits) when nothing ran

    It acts on the scheduler's requests only through the callables it is given:
    ``fork(parent, child_id)`` (a new beam sharing ``parent``'s blocks),
    ``drop(req, status)`` (take a request out of its queue and free it) and
    ``release_reserved(req)`` (its reserved ``max_num_seqs`` seats are no longer needed).
    """

    def __init__(self, requests: Mapping[str, Request],
                 fork: Callable[[Request, str], Request],
                 drop: Callable[[Request, RequestStatus], None],
                 release_reserved: Callable[[Request], None]) -> None:
        self.groups: dict[str, BeamGroup] = {}
        self._requests = requests
        self._fork = fork
        self._drop = drop
        self._release_reserved = release_reserved
        # Groups whose every live beam reported in the current ``update_from_output``.
        self._ready: dict[str, BeamGroup] = {}

    @property
    def active(self) -> bool:
        """Whether some beam search request is live."""
        return bool(self.groups)

    @staticmethod
    def width(root: Request, blocks_per_beam: int, usable_blocks: int) -> int:
        """The beam width of beam search request ``root``.  Raises ValueError if its
        beams, which wait for each other every step, could not all hold their
        ``blocks_per_beam`` KV blocks at once."""
        width = max(1 + len(root.fork_ids), root.sampling_params.best_of or 1)
        blocks = width * blocks_per_beam
        if blocks > usable_blocks:
            raise ValueError(
                f"beam search with beam width {width} needs up to {blocks} KV blocks "
                f"at once, more than the {usable_blocks} that exist")
        return width

    def start(self, root: Request, width: int) -> None:
        """Make ``root`` (about to be queued) the first beam of a new group: it reserves
        the seats of the beams it will fork into and reports its top-K next tokens."""
        sp = root.sampling_params
        stops = set(sp.stop_token_ids or ())
        if not sp.ignore_eos and root.eos_token_id is not None:
            stops.add(root.eos_token_id)
        group = BeamGroup(root.request_id, [root.request_id, *root.fork_ids], width,
                          root.max_tokens, sp.length_penalty, frozenset(stops))
        root.fork_ids = []
        root.reserved_slots = width - 1
        root.beam_group = group.group_id
        # Raw log-softmax top-K of the next token is what beam search scores.
        root.sampling_params = sp.clone(n=1, logprobs=group.num_candidates)
        group.live[root.request_id] = 0.0
        self.groups[group.group_id] = group

    def abort(self, request_id: str, status: RequestStatus) -> bool:
        """If ``request_id`` names a group, drop all its beams with ``status``: True."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for b in list(group.live):
            self._drop(self._requests[b], status)
        return True

    def on_token(self, beam: Request,
                 tokens: list[int], logprobs: tuple[list[int], list[float], int] | None,
                 ) -> None:
        """A beam's step result: once it sampled, its top-K candidates (``logprobs``
        after the sampled token) are recorded; the beam's own output is not touched
        (``on_update`` appends the token the group chooses)."""
        group = self.groups[beam.beam_group]  # type: ignore[index]
        if tokens and logprobs is not None and group.record(
                beam.request_id, logprobs[0][1:], logprobs[1][1:]):
            self._ready[group.group_id] = group

    def on_update(self) -> list[EngineCoreOutput]:
        """Advance every group whose beams all reported in this update; the outputs of
        the groups that finished (one per reported hypothesis)."""
        if not self._ready:
            return []
        ready, self._ready = self._ready, {}
        outputs: list[EngineCoreOutput] = []
        for group in ready.values():
            outputs.extend(self._advance(group))
        return outputs

    def on_recompute(self, req: Request) -> None:
        """``req`` is admitted from the waiting queue, to be computed from scratch."""
        if req.beam_group is not None:
            # A beam recomputed from scratch samples its next token again and must
            # report it again: a report from before its preemption would let the group
            # advance while the runner's row (rebuilt without the sampled token) is
            # mid-prompt, and the chosen token would then overwrite a prompt token
            # instead of following it.
            self.groups[req.beam_group].pending.pop(req.request_id, None)

    def deadlock_victim(self, running: Iterable[Request],
                        anything_waits: bool) -> Request | None:
        """Called when a step scheduled nothing.  If requests wait, the running requests
        are beams waiting for group-mates that cannot get in (a deadlock only beams can
        cause): the newest beam, which the scheduler preempts to the back of the queue
        to make room.  None otherwise."""
        if not self.groups or not anything_waits:
            return None
        beams = [r for r in running if r.beam_group is not None]
        return beams[-1] if beams else None

    def _advance(self, group: BeamGroup) -> list[EngineCoreOutput]:
        """Apply one beam step: keep/fork/drop beams, or report the finished group."""
        requests = self._requests
        step = group.advance({b: requests[b].output_token_ids for b in group.live})
        if step.done:
            return self._finish(group)
        used: set[str] = set()
        appends: list[tuple[Request, int]] = []
        live: dict[str, float] = {}
        for parent_id, token, score in step.keep:  # forks first: they copy pre-append tokens
            parent = requests[parent_id]
            child = parent if parent_id not in used else self._fork(parent,
                                                                    group.new_beam_id())
            used.add(parent_id)
            appends.append((child, token))
            live[child.request_id] = score
        for b in group.live:
            if b not in used:
                self._drop(requests[b], RequestStatus.FINISHED_ABORTED)
        for beam, token in appends:
            beam.append_output_token_id(token)
            if beam.status == RequestStatus.RUNNING:
                beam.token_override = token
            self._release_reserved(beam)
        group.live = live
        return []

    def _finish(self, group: BeamGroup) -> list[EngineCoreOutput]:
        del self.groups[group.group_id]
        any_beam = self._requests[next(iter(group.live))]
        cached, first = max(any_beam.num_cached_tokens, 0), any_beam.first_scheduled_time
        for b in list(group.live):
            self._drop(self._requests[b], RequestStatus.FINISHED_STOPPED)
        outs = []
        for out_id, hyp in zip(group.output_ids, group.results()):
            outs.append(EngineCoreOutput(
                request_id=out_id, new_token_ids=hyp.token_ids,
                finish_reason=FinishReason.STOP if hyp.stopped else FinishReason.LENGTH,
                num_cached_tokens=cached, cumulative_logprob=hyp.cumulative_logprob,
                first_scheduled_time=first))
        return outs
