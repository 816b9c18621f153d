"""Which tokens a row may sample: grammar bitmasks, ``allowed_token_ids``, ``bad_words``
and per-request logits processors (the sampler's one hook for all of them).

:func:`build` returns ``None`` unless some row of the step uses one of them, so the
sampler's fast paths are untouched for everyone else.  Costs per step: the grammar
bitmask is filled by the runner (``worker/structured_output/``) and copied once;
``allowed_token_ids`` is ``O(R * V)`` for the ``R`` restricted rows; bad words are
``O(sum of bad-word lengths)`` per row; logits processors run one Python call per row
that has them (offline API; those rows keep the engine synchronous).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.sample.metadata import SamplingRequestView, SparseLogitUpdate, _to_device


@dataclass(frozen=True)
class LogitsProcessorCall:
    """Row ``row`` runs ``fns`` on its logits, given its prompt and output so far."""

    row: int
    fns: Sequence[Callable[..., torch.Tensor]]
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(frozen=True)
class TokenConstraints:
    grammar_bitmask: torch.Tensor | None  # [N, ceil(V/32)] int32 (device), row per row
    allowed_rows: torch.Tensor | None  # [R] int64: rows restricted to allowed_token_ids
    allowed_mask: torch.Tensor | None  # [R, V] bool: True where the token is allowed
    banned: SparseLogitUpdate | None  # (row, token) pairs set to -inf (bad words)
    processors: list[LogitsProcessorCall]


def _banned_by_bad_words(requests: Sequence[SamplingRequestView], vocab_size: int
                         ) -> tuple[list[int], list[int]]:
    """vLLM's rule: a bad word's last token is banned when the output ends with the
    word's other tokens (a one-token word is always banned)."""
    rows: list[int] = []
    toks: list[int] = []
    for i, r in enumerate(requests):
        out = r.output_token_ids
        for ids in r.params.bad_words_token_ids or []:
            prefix = ids[:-1]
            if len(prefix) <= len(out) and (not prefix or out[-len(prefix):] == prefix) \
                    and 0 <= ids[-1] < vocab_size:
                rows.append(i)
                toks.append(ids[-1])
    return rows, toks


def build(requests: Sequence[SamplingRequestView], device: torch.device, vocab_size: int,
          grammar_bitmask: torch.Tensor | None = None) -> TokenConstraints | None:
    """The step's constraints (``None`` when no row has any).  ``grammar_bitmask`` has
    one row per request (filled by the runner, host or device; all ones for rows
    without a grammar)."""
    restricted = [i for i, r in enumerate(requests) if r.params.allowed_token_ids]
    bad_rows, bad_toks = _banned_by_bad_words(requests, vocab_size)
    calls = [LogitsProcessorCall(i, r.params.logits_processors, r.prompt_token_ids,
                                 r.output_token_ids)
             for i, r in enumerate(requests) if r.params.logits_processors]
    if grammar_bitmask is None and not restricted and not bad_rows and not calls:
        return None
    allowed_rows = allowed_mask = None
    if restricted:
        mask = torch.zeros(len(restricted), vocab_size, dtype=torch.bool)
        for j, i in enumerate(restricted):
            ids = [t for t in requests[i].params.allowed_token_ids or [] if t < vocab_size]
            mask[j, ids] = True
        allowed_rows = _to_device(restricted, torch.int64, device)
        allowed_mask = _to_device(mask, torch.bool, device)
    banned = None
    if bad_rows:
        banned = SparseLogitUpdate(rows=_to_device(bad_rows, torch.int64, device),
                                   token_ids=_to_device(bad_toks, torch.int64, device))
    g_mask = None
    if grammar_bitmask is not None:
        g_mask = grammar_bitmask if grammar_bitmask.device == device else _to_device(
            grammar_bitmask, torch.int32, device)
    return TokenConstraints(g_mask, allowed_rows, allowed_mask, banned, calls)


def _call(fn: Callable[..., torch.Tensor], call: LogitsProcessorCall,
          row: torch.Tensor) -> torch.Tensor:
    try:
        nargs = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        nargs = 2
    if nargs >= 3:
        return fn(list(call.prompt_token_ids), list(call.output_token_ids), row)
    return fn(list(call.output_token_ids), row)


def apply(logits: torch.Tensor, tc: TokenConstraints, owned: bool = False) -> torch.Tensor:
    """``logits`` (fp32) with the constraints applied, out of place unless ``owned``
    (the caller's private copy: the grammar mask is then applied to it in place)."""
    if tc.processors:
        logits = logits.clone()
        for call in tc.processors:
            row = logits[call.row]
            for fn in call.fns:
                row = _call(fn, call, row)
            logits[call.row] = row
    if tc.allowed_rows is not None:
        assert tc.allowed_mask is not None
        sub = logits.index_select(0, tc.allowed_rows).masked_fill(~tc.allowed_mask,
                                                                  float("-inf"))
        logits = logits.index_copy(0, tc.allowed_rows, sub)
    if tc.banned is not None:
        logits = logits.index_put((tc.banned.rows, tc.banned.token_ids),
                                  logits.new_full((), float("-inf")))
    if tc.grammar_bitmask is not None:
        if not (owned or tc.processors or tc.allowed_rows is not None
                or tc.banned is not None):
            logits = logits.clone()  # nothing above made a copy yet
        apply_bitmask_(logits, tc.grammar_bitmask)
    return logits


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``-inf`` where ``bitmask`` (one row per logits row) forbids a token.
    xgrammar's kernel (CPU, or CUDA/Triton on the device; no host sync)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`apply_bitmask_` in plain torch: ``logits`` with ``-inf`` at
    the tokens ``bitmask`` forbids in ``rows`` (out of place; ``bitmask[i]`` belongs to
    logits row ``rows[i]``).  About 3x slower than xgrammar's CPU kernel."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    sub = logits.index_select(0, rows).masked_fill(allowed == 0, float("-inf"))
    return logits.index_copy(0, rows, sub)


__all__: list[Any] = ["TokenConstraints", "apply", "build"]
