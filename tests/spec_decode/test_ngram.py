"""The vectorised n-gram lookup against a direct reference (property test)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.worker.spec_decode.ngram import NgramProposer, ngram_propose


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Directly: the match length at every earlier end position, the longest (>= lo),
    the latest such end with k tokens after it (else the earliest), what followed it."""
    n = len(tokens)
    m = min(hi, n - 1)
    lengths = []
    for e in range(n - 1):
        length = 0
        while length < m and e - length >= 0 and tokens[e - length] == tokens[n - 1 - length]:
            length += 1
        lengths.append(length)
    best = max(lengths, default=0)
    if best < lo:
        return []
    ends = [e for e, length in enumerate(lengths) if length == best]
    full = [e for e in ends if e + k < n]
    e = full[-1] if full else ends[0]
    return tokens[e + 1:e + 1 + k]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 3))
def test_matches_reference(tokens, k, lo, extra):
    hi = lo + extra
    got = ngram_propose(np.asarray(tokens, dtype=np.int64), k, lo, hi).tolist()
    assert got == reference(tokens, k, lo, hi)


def test_proposer_caps_and_rows():
    rows = np.array([[1, 2, 3, 1, 2, 0, 0], [5, 6, 7, 8, 0, 0, 0]])
    p = NgramProposer(3, 1, 2)
    assert p.propose(rows, np.array([5, 4]), [0, 1], [3, 3]) == [[3, 1, 2], []]
    assert p.propose(rows, np.array([5, 4]), [0], [1]) == [[3]]
    assert p.propose(rows, np.array([5, 4]), [0], [0]) == [[]]
