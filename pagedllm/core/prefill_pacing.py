"""The throughput policy's prefill pacing: how many prompt tokens a step may compute.

The scheduler (``core/scheduler.py``) asks :func:`prefill_cap_for` once per step while
requests wait under the throughput policy; the answer caps the prompt tokens -- running
requests' unfinished chunks first, then waiting requests -- of that step.  Torch-free,
O(running) per step.  :func:`fill_sizes` picks, once at start-up from the chunk CUDA
graphs' replay times, the step sizes that cap is rounded up to.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from pagedllm.core.request_queue import DUE_NOW, LongestFirstQueue
from pagedllm.request import Request

# A chunk size stays a fill target unless its step costs this much more than mixing the
# neighbouring targets would (the chord of the cost curve's lower convex hull).
FILL_MARGIN = 0.05


def fill_sizes(costs: Sequence[tuple[int, float]], margin: float = FILL_MARGIN) -> list[int]:
    """The step sizes worth filling, from ``costs``: ``(tokens, ms)`` of the runner's
    padded step sizes (its chunk graphs' replay times).  A size whose cost lies more
    than ``margin`` above the lower convex hull of the curve is left out: its tokens are
    cheaper spread over the hull's neighbouring sizes (e.g. a W4A16 model whose layers
    switch from the tensor-core kernel to dequantise + cuBLAS between two sizes costs
    nearly the larger step's time at the smaller one).  The hull's vertices always
    stay; a convex curve (a bf16 model's roofline) keeps every size."""
    pts = sorted(costs)
    hull: list[tuple[int, float]] = []
    for p in pts:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  <= (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    keep = []
    for x, y in pts:
        i = bisect.bisect_left(hull, (x, float("-inf")))
        if hull[i][0] == x:
            keep.append(x)
            continue
        (x0, y0), (x1, y1) = hull[i - 1], hull[i]
        if y <= (y0 + (y1 - y0) * (x - x0) / (x1 - x0)) * (1 + margin):
            keep.append(x)
    return keep


def prefill_cap_for(running: Iterable[Request], waiting: LongestFirstQueue, budget: int,
                    step_sizes: Sequence[int]) -> int:
    """The prompt tokens -- running requests' unfinished chunks first, then waiting
    requests -- that a step may compute (at least 1), given the ``running`` requests,
    the ``waiting`` queue (longest ``max_tokens`` first), the step's token ``budget``
    and the sizes a mixed step is filled up to (``step_sizes``, ascending:
    :func:`fill_sizes` of the runner's chunk CUDA graph sizes).

    A decode step's GEMMs read every weight however few tokens it carries, so prompt
    tokens spread over the decode steps ride along almost free, while a step full of
    prompt tokens is compute-bound and delays every decode.  Prefill is therefore
    paced: ``L``, the longest remaining output of any request, is a lower bound on
    the steps left (the makespan), and a waiting request that will generate ``o``
    tokens must start decoding by step ``L - o``.  The rate is the smallest even
    prefill rate meeting every such deadline in queue (longest-first) order::

        rate = max(P / max(1, L - o_P), max over j of (P + S_j) / max(1, L - o_j))

    with ``P`` the prompt tokens of running requests still to compute (unfinished
    chunks, which go first; ``o_P`` the longest remaining output among them, so they
    too finish by their deadline rather than in the next step whatever their size)
    and ``S_j`` the tokens of the first ``j`` waiting requests (the first 512 only,
    to bound the per-step cost).  When every request has the same ``max_tokens`` the
    first deadline is step 0 and the rule is "prefill everything now", as under FCFS.
    Only requests of known length (``Request.length_known``: they cannot stop before
    ``max_tokens``) are planned with: one that may stop early sets no horizon and is due
    now (its ``max_tokens`` is only a bound, and pacing by it could delay prompts for
    steps that never come), so a batch of such requests runs as under FCFS.

    With CUDA graphs the runner pads a mixed step up to its graph's size, so the cap
    is raised to fill the next of ``step_sizes`` (tokens in the padding cost nothing
    extra; a size dearer per token than its neighbours is not listed).  A waiting
    request's tokens all count as to compute (prefix-cache hits are not known before
    it is admitted; counting them only makes the rate conservative).
    """
    horizon = waiting.longest_remaining_output()
    p_run = decodes = 0
    chunk_out = 0  # the longest output of a request with an unfinished chunk
    for r in running:
        left = r.num_tokens - r.num_computed_tokens
        if r.length_known:
            rest = r.max_tokens - r.num_output_tokens
            horizon = max(horizon, rest)
        else:  # it may stop at any step: it sets no horizon, and its chunk is due now
            rest = -DUE_NOW
        if left > 1:
            p_run += left
            chunk_out = max(chunk_out, rest)
        elif r.num_placeholders or left == 1:
            decodes += 1
    rate = waiting.paced_rate(p_run, horizon, limit=budget,
                              running_slack=horizon - chunk_out)
    cap = min(rate, budget - decodes)
    if cap > 0 and step_sizes:
        i = bisect.bisect_left(step_sizes, decodes + cap)
        if i < len(step_sizes) and step_sizes[i] <= budget:
            cap = step_sizes[i] - decodes
    return max(cap, 1)
