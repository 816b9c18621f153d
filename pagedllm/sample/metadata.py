"""SamplingMetadata: one step's sampling parameters as batched tensors.

The model runner calls :meth:`SamplingMetadata.build` once per step with one
:class:`SamplingRequestView` per logits row, in row order.  The result carries only the
tensors the batch needs: a field is ``None`` when no row uses the feature, which is what
lets :class:`~pagedllm.sample.sampler.Sampler` skip that stage entirely.

Cost of ``build`` (Python + host->device copies), with ``N`` rows:

* always: ``O(N)``; in particular it never touches ``output_token_ids`` beyond ``len()``,
  so it does not grow with the number of tokens generated so far;
* ``logit_bias``: ``O(total bias entries)``;
* ``min_tokens``: ``O(stop ids)`` per row still below its minimum;
* penalties: ``O(P * V + sum(len(prompt) + len(output)))`` over the ``P`` penalised rows
  only -- the id lists are flattened once and turned into ``[P, V]`` counts with one
  vectorised ``scatter_add_``.  This is the one part that grows with sequence length; a
  runner that wants it flat can keep persistent per-row counts instead and pass them in
  (the sampler only reads :class:`PenaltyTensors`).

No copy here waits for the device: on CUDA every host list goes through pinned memory
with a non-blocking copy (``torch.tensor(..., device="cuda")`` would synchronise the
stream and stall async scheduling).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams, SamplingType


class SamplingRequestView(Protocol):
    """What the builder reads from one running request (the runner's per-row state).

    ``generator`` is the request's own RNG (the runner creates
    ``torch.Generator(device).manual_seed(seed)`` for seeded requests and keeps it for the
    request's lifetime); when set, the row's random draws come only from it.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


@dataclass(frozen=True)
class PenaltyTensors:
    """Penalty inputs for the ``P`` penalised rows (``rows`` indexes the batch).

    ``prompt_mask[p, t]``: token ``t`` occurs in row ``rows[p]``'s prompt.
    ``output_counts[p, t]``: how often ``t`` occurs in that row's output so far (int32).
    """

    rows: torch.Tensor  # [P] int64
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    prompt_mask: torch.Tensor  # [P, V] bool
    output_counts: torch.Tensor  # [P, V] int32


def _to_device(values: Sequence | torch.Tensor, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device``, without a stream sync."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or t.device.type == "cuda":  # (cuda:0 != cuda: already there)
        return t.to(device)
    # Pinned blocks come from torch's caching host allocator, which keeps each one until
    # the copy reading it has finished.
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class SparseLogitUpdate:
    """Entries ``(rows[i], token_ids[i])`` of the logits to change (all 1-D, same length)."""

    rows: torch.Tensor  # int64
    token_ids: torch.Tensor  # int64
    values: torch.Tensor | None = None  # float32; None where the update is a fixed mask


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling inputs for ``N`` logits rows (all tensors on the runner's device).

    Invariants: ``temperature`` holds 1.0 on greedy rows (they are never divided, it only
    avoids 0-division in the shared random path); ``top_k`` holds ``V`` on rows without
    top-k; ``top_p`` 1.0 and ``min_p`` 0.0 on rows without them.  ``generators`` maps a
    row index to that row's RNG for random rows that have one.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [N] bool; None when all_greedy or all_random
    temperature: torch.Tensor | None  # [N] float32; None when all_greedy
    top_k: torch.Tensor | None  # [N] int64; None when no random row truncates by k
    max_top_k: int  # largest k < V among rows using top-k (host int: sizes torch.topk)
    top_p: torch.Tensor | None  # [N] float32; None when no random row uses top-p
    min_p: torch.Tensor | None  # [N] float32; None when no random row uses min-p
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # largest `logprobs` in the batch; None if none asked
    logit_bias: SparseLogitUpdate | None
    min_tokens_mask: SparseLogitUpdate | None  # (row, token) pairs to set to -inf
    penalties: PenaltyTensors | None
    # Grammar bitmasks, allowed_token_ids, bad_words, logits processors
    # (sample/token_constraints.py); None when no row uses any of them.
    constraints: Any = None

    @classmethod
    def build(cls, requests: Sequence[SamplingRequestView], device: torch.device,
              vocab_size: int, num_in_flight: Sequence[int] | None = None,
              ) -> SamplingMetadata:
        """Batch ``requests`` (one per logits row, in row order) for a ``vocab_size`` model.

        ``num_in_flight[i]``: tokens row ``i`` has generated that are not yet in its
        ``output_token_ids`` (async scheduling: the previous step's, still on the device);
        they count towards ``min_tokens``.

        Token ids ``>= vocab_size`` in ``logit_bias`` or ``stop_token_ids`` are ignored
        (the input processor is where they are rejected with a message).
        """
        n = len(requests)
        if n == 0:
            raise ValueError("SamplingMetadata.build needs at least one request")
        params = [r.params for r in requests]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        temperature = top_k = top_p = min_p = greedy_mask = None
        max_top_k = vocab_size
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
            temperature = _to_device(temps, torch.float32, device)
            # Greedy rows were normalised by SamplingParams (top_k=-1, top_p=1, min_p=0),
            # so "any row uses it" below is automatically about random rows.
            ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
            limited = [k for k in ks if k < vocab_size]
            if limited:
                top_k = _to_device(ks, torch.int64, device)
                max_top_k = max(limited)
            if any(p.top_p < 1.0 for p in params):
                top_p = _to_device([p.top_p for p in params], torch.float32, device)
            if any(p.min_p > 0.0 for p in params):
                min_p = _to_device([p.min_p for p in params], torch.float32, device)
            generators = {i: r.generator for i, r in enumerate(requests)
                          if not greedy[i] and r.generator is not None}
            if not all_random:
                greedy_mask = _to_device(greedy, torch.bool, device)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=n, vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random,
            greedy_mask=greedy_mask, temperature=temperature, top_k=top_k,
            max_top_k=max_top_k, top_p=top_p,
            min_p=min_p, generators=generators,
            max_num_logprobs=max(asked) if asked else None,
            logit_bias=_build_logit_bias(params, device, vocab_size),
            min_tokens_mask=_build_min_tokens(requests, device, vocab_size, num_in_flight),
            penalties=_build_penalties(requests, device, vocab_size),
        )


def _build_logit_bias(params: Sequence[SamplingParams], device: torch.device,
                      vocab_size: int) -> SparseLogitUpdate | None:
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            if t < vocab_size:
                rows.append(i)
                toks.append(t)
                vals.append(v)
    if not rows:
        return None
    return SparseLogitUpdate(
        rows=_to_device(rows, torch.int64, device),
        token_ids=_to_device(toks, torch.int64, device),
        values=_to_device(vals, torch.float32, device))


def _build_min_tokens(requests: Sequence[SamplingRequestView], device: torch.device,
                      vocab_size: int, num_in_flight: Sequence[int] | None,
                      ) -> SparseLogitUpdate | None:
    # EOS is masked even under ignore_eos, as vLLM does (it adds the model's EOS to the
    # min_tokens stop set unconditionally): the rule stays one simple sentence.
    rows: list[int] = []
    toks: list[int] = []
    for i, r in enumerate(requests):
        in_flight = 0 if num_in_flight is None else int(num_in_flight[i])
        if len(r.output_token_ids) + in_flight >= r.params.min_tokens:
            continue
        stop_ids = set(r.params.stop_token_ids or [])
        if r.eos_token_id is not None:
            stop_ids.add(r.eos_token_id)
        for t in sorted(stop_ids):
            if 0 <= t < vocab_size:
                rows.append(i)
                toks.append(t)
    if not rows:
        return None
    return SparseLogitUpdate(rows=_to_device(rows, torch.int64, device),
                             token_ids=_to_device(toks, torch.int64, device))


def _uses_penalties(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0)


def _token_counts(id_lists: Sequence[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """``[len(id_lists), V]`` int32 occurrence counts, by one flat ``scatter_add_``.

    The id lists are flattened with ``np.fromiter`` (about 3x faster than building a
    tensor from a Python list).  Ids outside ``[0, V)`` are dropped rather than trusted: a
    bad id must not write into another row's counts.
    """
    rows = len(id_lists)
    counts = torch.zeros(rows * vocab_size, dtype=torch.int32, device=device)
    sizes = np.fromiter(map(len, id_lists), dtype=np.int64, count=rows)
    total = int(sizes.sum())
    if total == 0:
        return counts.view(rows, vocab_size)
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=total)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), sizes)
    ok = (flat >= 0) & (flat < vocab_size)
    index = _to_device(torch.from_numpy(row_of[ok] * vocab_size + flat[ok]), torch.int64,
                       device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts.view(rows, vocab_size)


def _build_penalties(requests: Sequence[SamplingRequestView], device: torch.device,
                     vocab_size: int) -> PenaltyTensors | None:
    rows = [i for i, r in enumerate(requests) if _uses_penalties(r.params)]
    if not rows:
        return None
    sel = [requests[i] for i in rows]

    def col(name: str) -> torch.Tensor:
        return _to_device([getattr(r.params, name) for r in sel], torch.float32, device)

    return PenaltyTensors(
        rows=_to_device(rows, torch.int64, device),
        presence=col("presence_penalty"), frequency=col("frequency_penalty"),
        repetition=col("repetition_penalty"),
        prompt_mask=_token_counts([r.prompt_token_ids for r in sel], vocab_size, device) > 0,
        output_counts=_token_counts([r.output_token_ids for r in sel], vocab_size, device))
