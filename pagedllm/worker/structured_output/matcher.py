"""Per-request grammar state in the model runner, and the step's token bitmask.

::

    output tokens ──accept──► GrammarMatcher ──fill──► bitmask row (host, int32 words)
                                                          │ one copy per step
                                                          ▼
                                          Sampler: logits[row, t] = -inf where bit t is 0

A :class:`GrammarState` lives as long as its request does in the runner (also across a
recompute preemption).  It is told every token the request appends
(:meth:`GrammarState.advance`), and re-synchronised when the scheduler hands the
request back with fewer output tokens than it has seen (:meth:`GrammarState.sync`:
xgrammar rolls back without limit).  With a reasoning parser the constraint switches on
only after the reasoning's end marker appears in the output.

A row whose grammar has ended (or could not follow a token it was given) allows only
its stop tokens, so it ends instead of sampling garbage; a grammar that allows nothing
at all (an unsatisfiable regex) does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr


class GrammarState:
    """One request's matcher.  ``stop_token_ids``: the tokens that end the request (EOS
    and its ``stop_token_ids``); the grammar allows them once it is complete."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int],
                 reasoning_end: Sequence[int] | None = None) -> None:
        self.compiled = compiled
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=self.stop_token_ids or None)
        self.reasoning_end = list(reasoning_end or [])
        self.active = not self.reasoning_end
        self.failed = False
        # Whether the matcher has terminated (accepted one of its stop tokens: ours, or
        # the tokenizer's when we have none), tracked here because asking xgrammar costs
        # ~2 us a call, twice a row per step.
        self.ended = False
        self._stops = frozenset(self.stop_token_ids
                                or compiled.tokenizer_info.stop_token_ids)
        self.num_seen = 0  # output tokens advanced over (accepted or pre-activation)
        self.num_accepted = 0
        self._tail: list[int] = []  # last tokens before activation (end-marker search)
        # Bitmask words xgrammar writes per row: its vocabulary's (the tokenizer's), which
        # may be narrower than the model's padded one (the rest of a row stays zero).
        self.words = int(xgr.get_bitmask_shape(1, compiled.tokenizer_info.vocab_size)[1])

    def fork(self, output_token_ids: Sequence[int]) -> GrammarState:
        """A fresh state for a sequence continuing with ``output_token_ids`` (n > 1)."""
        st = GrammarState(self.compiled, self.stop_token_ids, self.reasoning_end)
        for t in output_token_ids:
            st.advance(t)
        return st

    def advance(self, token: int) -> None:
        if self.observe(token):
            self.record(token, self.matcher.accept_token(token))

    def observe(self, token: int) -> bool:
        """Count ``token`` as seen; True when the matcher must accept it (then call
        :meth:`record` with the result), False when it is not the grammar's business:
        the reasoning has not ended yet, or the grammar has (a token sampled after the
        end while an async step was in flight is dropped)."""
        self.num_seen += 1
        if not self.active:
            n = len(self.reasoning_end)
            self._tail = (self._tail + [token])[-n:]
            self.active = self._tail == self.reasoning_end
            return False
        return not (self.failed or self.ended)

    def record(self, token: int, accepted: bool) -> None:
        """The matcher's verdict on ``token``, which :meth:`observe` let through."""
        if accepted:
            self.num_accepted += 1
            self.ended = token in self._stops
        else:
            self.failed = True

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Match the scheduler's view of the output after a preemption (it may hold
        fewer tokens than the runner saw: a step in flight was dropped)."""
        if len(output_token_ids) == self.num_seen:
            return
        self.matcher.reset()
        self.active, self.failed, self.ended = not self.reasoning_end, False, False
        self.num_seen = self.num_accepted = 0
        self._tail = []
        for t in output_token_ids:
            self.advance(t)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into ``bitmask[row]`` (a host int32
        tensor as wide as the model's vocabulary needs).  A grammar that allows nothing
        at all (an unsatisfiable regex) gets its stop tokens instead: the request ends
        rather than sampling garbage."""
        if not self.active:
            bitmask[row].fill_(-1)
            return
        if self.failed or self.ended:
            allow_only(bitmask[row].numpy(), self.stop_token_ids)
            return
        if self.words == bitmask.shape[1]:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:  # xgrammar ignores strides: fill a row of its own width, then copy it in
            own = torch.empty(1, self.words, dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(own, 0)
            bitmask[row, :self.words] = own[0]
            bitmask[row, self.words:] = 0
        if not bitmask[row].any():
            allow_only(bitmask[row].numpy(), self.stop_token_ids)

    def fill_drafts(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """Speculative decoding: the allowed tokens at each of a verify step's
        ``len(drafts) + 1`` positions, into ``bitmask[row .. row + len(drafts)]``:
        position ``j`` as if ``drafts[:j]`` had been accepted.  The matcher walks the
        drafts and rolls back (xgrammar: unlimited rollback), so its state is unchanged.
        At the first draft the grammar refuses (or a stop token: the request ends there)
        the walk stops; that draft is masked out at its own position, so verification
        rejects it and the rows after it are never read (left all-allowed).  A state not
        (or no longer) constraining fills every position like its first.  Called once
        per request with drafts: a loop over <= k positions, not over tokens."""
        self.fill(bitmask, row)
        if not self.active or self.failed or self.ended:
            bitmask[row + 1:row + 1 + len(drafts)] = bitmask[row]
            return
        taken = 0
        for j, t in enumerate(drafts):
            if t in self._stops or not self.matcher.accept_token(t):
                bitmask[row + 1 + j:row + 1 + len(drafts)] = -1
                break
            taken += 1
            self.fill(bitmask, row + 1 + j)
        if taken:
            self.matcher.rollback(taken)


def allow_only(words: np.ndarray, token_ids: Sequence[int]) -> None:
    """Set the bitmask row ``words`` (int32) to allow exactly ``token_ids``."""
    words[:] = 0
    arr = words.view(np.uint32)
    for t in token_ids:
        if t // 32 < len(arr):
            arr[t // 32] |= np.uint32(1 << (t % 32))


def fill_bitmask(states: Sequence[GrammarState | None], vocab_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(states), ceil(V / 32)]`` int32 host bitmask, one row per state (a ``None``
    state -- a request without a grammar -- allows every token).

    ``out`` (e.g. a pinned buffer with at least that many rows) is filled in place.
    A row that allows no token at all is given its stop tokens instead
    (:meth:`GrammarState.fill`)."""
    rows, width = len(states), xgr.get_bitmask_shape(1, vocab_size)[1]
    mask = out[:rows] if out is not None else torch.empty(rows, width, dtype=torch.int32)
    for i, st in enumerate(states):
        if st is None:
            mask[i].fill_(-1)
        else:
            st.fill(mask, i)
    return mask
