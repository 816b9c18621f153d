"""N-gram prompt lookup: propose the tokens that followed the sequence's own suffix the
last time that suffix occurred (Saxena's "prompt lookup decoding"; vLLM's ``ngram``).

```
 tokens   a b c d x y z ... a b c d  |  drafts
                  ^^^^^^^^^ the suffix "a b c d" (length 4) matched at positions 0..3,
                            so the drafts are the k tokens after it: "x y z ..."
```

The longest match with ``prompt_lookup_min <= length <= prompt_lookup_max`` wins; among
equally long matches the latest (most recent context) that has ``k`` tokens after it.
One pass of numpy per request, ``O(len(tokens) * prompt_lookup_max)``, and no Python
loop over tokens.  Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (1-D int array); empty when
    no suffix of at least ``min_n`` tokens occurred before."""
    n = len(tokens)
    m = min(max_n, n - 1)
    if m < min_n or k <= 0:
        return tokens[:0]
    # match[e]: length (<= m) of the common suffix of tokens[:e + 1] and tokens, for the
    # candidate ends e in [0, n - 2] (the suffix itself, e = n - 1, is excluded).
    ends = n - 1
    alive = np.ones(ends, dtype=bool)
    match = np.zeros(ends, dtype=np.int64)
    for j in range(m):  # over the n-gram length (<= max_n), not over tokens
        # Compare tokens[e - j] with tokens[n - 1 - j]; ends e < j have no such token.
        eq = np.zeros(ends, dtype=bool)
        eq[j:] = tokens[:ends - j] == tokens[n - 1 - j]
        alive &= eq
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < min_n:
        return tokens[:0]
    # The latest longest match that still has k tokens after it, else the earliest one
    # (the most continuation, e.g. inside a run of one repeated token).
    cand = np.flatnonzero(match == best)
    full = cand[cand + k < n]
    e = int(full[-1]) if len(full) else int(cand[0])
    return tokens[e + 1:e + 1 + k]


class NgramProposer:
    """The ``ngram`` method behind the proposer interface (``propose``)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        """Drafts for each of ``rows``: ``token_ids[row, :num_tokens[row]]`` is the
        request's sequence, ``max_drafts[i]`` caps its drafts (0: none)."""
        out: list[list[int]] = []
        for row, cap in zip(rows, max_drafts):
            if cap <= 0:
                out.append([])
                continue
            d = ngram_propose(token_ids[row, :int(num_tokens[row])], min(self.k, cap),
                              self.min_n, self.max_n)
            out.append(d.tolist())
        return out
