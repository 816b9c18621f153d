"""The runner's per-step grammar work over every sampled row, batched.

::

    step t's tokens ──advance()──► matchers ──fill()──► staging buffer (host; pinned on CUDA)
       one xgrammar call              one xgrammar call (threads for 16+ rows), no GIL

Per step, with ``R`` constrained rows, the host does one ``batch_accept_token`` call
(the tokens of the step just read back) and one ``batch_fill_next_token_bitmask`` call
(on xgrammar's threads when ``R >= MIN_THREADED_ROWS``; the Python GIL is released
during both) straight into the caller's staging buffer; Python itself only loops over
the requests to sort them (active grammar, ended grammar, no grammar / reasoning still
running), never over tokens.  Rows without an active grammar are set with one
vectorised assignment.  This replaced a per-row loop of ``accept_token`` and
``fill_next_token_bitmask`` calls plus a copy of the mask into the pinned buffer.

The buffer is ``[rows, ceil(V / 32)]`` int32 for the *model's* vocabulary ``V``; the
grammars may have been compiled for a smaller one (the tokenizer's, when the model pads
its embedding; ``backend.tokenizer_size``): xgrammar then fills a buffer of its own
width (it ignores strides, so no view will do), copied into the first
``ceil(V_tok / 32)`` words of each row, the rest zeroed (a grammar never allows a
padding id).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from pagedllm.worker.structured_output.matcher import GrammarState, allow_only


def _threads() -> int:
    """xgrammar's fill threads for a large batch: half the cores this process may use,
    at most 8 (beyond that the per-call thread start-up outweighs the split)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


# Fewer rows than this are filled on one thread: xgrammar starts its threads on every
# call (~40 us measured for 8), more than a small batch's whole fill (2-40 us a row).
MIN_THREADED_ROWS = 16


class GrammarBatch:
    """Batched advance and bitmask fill for the states of one step's rows."""

    def __init__(self, max_threads: int | None = None) -> None:
        threads = max_threads or _threads()
        self._single = xgr.BatchGrammarMatcher(1)
        self._threaded = xgr.BatchGrammarMatcher(threads) if threads > 1 else None
        self._narrow_buf = torch.empty(0, dtype=torch.int32)
        # Host seconds spent in advance() and fill() so far (``pagedllm bench structured``
        # reports them per step), and the number of fill() calls.
        self.advance_s = self.fill_s = 0.0
        self.num_fills = 0

    def _narrow(self, rows: int, words: int) -> torch.Tensor:
        """A reused contiguous ``[rows, words]`` host tensor for xgrammar to fill."""
        if self._narrow_buf.numel() < rows * words:
            self._narrow_buf = torch.empty(rows * words, dtype=torch.int32)
        return self._narrow_buf[:rows * words].view(rows, words)

    def advance(self, states: Sequence[GrammarState], tokens: Sequence[int]) -> None:
        """``states[i].advance(tokens[i])`` for every ``i``, the matchers' part in one call."""
        t0 = time.perf_counter()
        matchers, toks, owners = [], [], []
        for st, t in zip(states, tokens):
            if st.observe(t):
                matchers.append(st.matcher)
                toks.append(t)
                owners.append(st)
        if matchers:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, toks)
            for st, t, ok in zip(owners, toks, accepted):
                st.record(t, ok)
        self.advance_s += time.perf_counter() - t0

    def fill(self, states: Sequence[GrammarState | None], out: torch.Tensor) -> torch.Tensor:
        """Fill ``out[:len(states)]`` (a host int32 tensor ``[>= rows, ceil(V / 32)]``),
        one row per state (``None``: a request without a grammar, every token allowed),
        and return that slice.  A row that allows no token at all is given its stop
        tokens instead (the request ends rather than sampling garbage)."""
        t0 = time.perf_counter()
        n = len(states)
        mask = out[:n]
        arr = mask.numpy()
        free: list[int] = []
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        words = arr.shape[1]
        for i, st in enumerate(states):
            if st is None or not st.active:
                free.append(i)
            elif st.failed or st.ended:
                allow_only(arr[i], st.stop_token_ids)
            else:
                rows.append(i)
                matchers.append(st.matcher)
                words = st.words
        if free:
            arr[free] = -1
        if rows:
            batch = self._threaded if self._threaded is not None and \
                len(rows) >= MIN_THREADED_ROWS else self._single
            if words == arr.shape[1]:
                batch.batch_fill_next_token_bitmask(matchers, mask, rows)
            else:  # (xgrammar ignores strides: no view of the first ``words`` columns)
                narrow = self._narrow(len(rows), words)
                batch.batch_fill_next_token_bitmask(matchers, narrow)
                arr[rows, :words] = narrow.numpy()
                arr[rows, words:] = 0
            # (a scan of every row: no copy; re-setting a row that is already stop-only is a no-op)
            for i in np.flatnonzero(~arr[:, :words].any(axis=1)):
                st = states[int(i)]
                assert st is not None
                allow_only(arr[int(i)], st.stop_token_ids)
        self.fill_s += time.perf_counter() - t0
        self.num_fills += 1
        return mask
