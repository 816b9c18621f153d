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

The scheduler turns ``BeamStep.keep`` into block operations: the first new beam taken
from a parent reuses the parent's request, every further one forks it (sharing its KV
blocks; the shared partial block is copied on write when both append), and parents no
one chose are freed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


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
