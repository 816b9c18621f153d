"""The target's step-cost curve for the speculation policy (``spec_decode/policy.py``):
measured once at start-up, never guessed.

* **CUDA graphs** (the default on a GPU): the capture already times two replays of
  every graph it keeps (``CudaGraphRunner.replay_ms``); a plain decode step of B
  requests replays the decode graph of the smallest size >= B and a verify step of T
  tokens the chunk graph of the smallest size >= T, so those times *are* the curve (a
  step function: ``padded``).  No extra forward, no extra sync.
* **Eager** (CPU, ``enforce_eager``): forwards of 1, 2, 4, ... tokens (one request, no
  KV written: slot -1) up to the largest verify step, ``min(max_num_batched_tokens,
  max_num_seqs x (k + 1))`` and at most ``MAX_EAGER_TOKENS`` (CPU: ``MAX_CPU_TOKENS``;
  beyond, the policy takes cost as proportional to tokens), each with its logits, timed
  twice after one warm-up forward (the faster counts).  A single rank stops climbing
  once ``BUDGET_S`` is spent past ``MIN_EAGER_TOKENS`` (the policy continues the last
  segment's slope); tensor-parallel ranks run the whole ladder (they must run the same
  forwards).  Only done when speculative decoding is configured.

Both are measured at context ~0: see the policy's docstring for why that errs towards
not speculating.  The curve is logged at start-up.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from pagedllm.spec_decode.policy import StepCostCurve
from pagedllm.worker.input_batch import StepInputs

MAX_EAGER_TOKENS = 2048
MAX_CPU_TOKENS = 256
MIN_EAGER_TOKENS = 16
BUDGET_S = 1.0


def curve_from_graphs(graphs: Any) -> StepCostCurve | None:
    """The curve of a ``CudaGraphRunner``'s capture timings (None without chunk graphs:
    verify steps would then run eagerly, which those timings do not describe)."""
    decode = tuple(sorted((s.reqs, ms) for s, ms in graphs.replay_ms.items() if s.decode))
    mixed = tuple(sorted((s.tokens, ms) for s, ms in graphs.replay_ms.items()
                         if not s.decode))
    if not mixed:
        return None
    return StepCostCurve(decode, mixed, True, "CUDA graph replays timed at capture")


def eager_ladder(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below ``max_tokens`` (capped at ``MAX_EAGER_TOKENS``), then it."""
    top = max(1, min(max_tokens, MAX_EAGER_TOKENS))
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*sizes, top]


def _inputs(t: int, num_groups: int, block_size: int) -> StepInputs:
    """One request of ``t`` new tokens (ids 0) whose KV is written nowhere (its block
    table: the null block 0, as many times as ``t`` tokens span)."""
    g = num_groups - 1
    nb = -(-t // block_size)
    return StepInputs(
        input_ids=np.zeros(t, dtype=np.int64), positions=np.arange(t, dtype=np.int64),
        slot_mapping=np.full(t, -1, dtype=np.int64),
        query_start_loc=np.asarray([0, t], dtype=np.int32),
        seq_lens=np.asarray([t], dtype=np.int32),
        block_tables=np.zeros((1, nb), dtype=np.int32), max_query_len=t, max_seq_len=t,
        group_block_tables=np.zeros((g, 1, nb), dtype=np.int32) if g else None,
        group_slot_mapping=np.full((g, t), -1, dtype=np.int64) if g else None)


@torch.inference_mode()
def measure_eager(runner: Any, max_tokens: int) -> StepCostCurve:
    """Time the eager forward (+ logits of every row) of ``runner`` (a ``ModelRunner``)
    at ``eager_ladder(max_tokens)`` tokens."""
    dev = runner.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def forward(t: int) -> None:
        inp = _inputs(t, runner.num_kv_groups, runner.block_size)
        meta = runner._metadata(inp)
        hidden = runner.model(runner.h2d("ids", inp.input_ids),
                              runner.h2d("pos", inp.positions), meta, False)
        runner.model.compute_logits(hidden)

    if dev.type == "cpu":
        max_tokens = min(max_tokens, MAX_CPU_TOKENS)
    sizes = eager_ladder(max_tokens)
    lockstep = runner.config.parallel_config.world_size > 1
    start = time.perf_counter()
    forward(sizes[0])  # warm-up (first-call allocations)
    points: list[tuple[int, float]] = []
    for t in sizes:
        if t > MIN_EAGER_TOKENS and not lockstep and time.perf_counter() - start > BUDGET_S:
            break
        best = float("inf")
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            forward(t)
            sync()
            best = min(best, time.perf_counter() - t0)
        points.append((t, 1000 * best))
    # A step never costs more than a larger one (it could be padded to it): take the
    # running minimum from the right, which also irons out a noisy measurement's spike.
    for i in range(len(points) - 2, -1, -1):
        if points[i][1] > points[i + 1][1]:
            points[i] = (points[i][0], points[i + 1][1])
    return StepCostCurve((), tuple(points), False,
                         f"eager forwards timed at start-up on {dev.type}")


def measure_step_cost(runner: Any, max_num_seqs: int, max_num_batched_tokens: int,
                      k: int) -> StepCostCurve:
    """The curve for ``runner``: its graphs' capture timings, else eager forwards."""
    if runner.graphs is not None:
        curve = curve_from_graphs(runner.graphs)
        if curve is not None:
            return curve
    return measure_eager(runner, min(max_num_batched_tokens, max_num_seqs * (k + 1)))
