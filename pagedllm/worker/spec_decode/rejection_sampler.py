"""Lossless verification of drafts: the rejection sampler (vectorised torch; the CPU
path and the oracle for any kernel).

A request with ``k`` drafts ``d_1..d_k`` has ``k + 1`` logits rows: row ``j`` is the
target's distribution for the token after ``d_1..d_j`` (row 0: after the last real
token).  Every sampling parameter -- logit bias, min_tokens, penalties (counting the
drafts before the row as output), temperature, top-k, top-p, min-p -- is applied to
each row exactly as the ordinary sampler would, giving ``p_j``.  Then, left to right::

    accept d_{j+1}   with probability p_j(d_{j+1})        (u_j < p_j(d_{j+1}), u ~ U[0,1))
    on the first rejection: emit a token from the residual  (p_j - onehot(d_{j+1}))+ ,
                            normalised, and stop
    all k accepted:         emit the bonus token from p_k

A draft from a one-hot proposal ``q`` (n-gram lookup, or a greedy draft model) makes
``min(1, p/q)`` equal ``p(d)`` and the residual ``max(0, p - q)`` equal ``p`` with ``d``
removed; each emitted token is then distributed exactly as ``p_j`` (Leviathan et al.,
2023, with a point-mass draft).  Greedy rows accept ``d`` iff it is the argmax of their
processed logits and emit that argmax otherwise: token for token what decoding without
speculation emits.

Seeded requests draw ``u`` and the exponential-race noise from their own generator, so
their output is reproducible (it is a different draw sequence from decoding without
drafts, as in vLLM).  No ``.item()``/``.tolist()``: the output stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, _argmax, random_sample

PLACEHOLDER = -1  # pads a request's output row after its last emitted token


@dataclass(frozen=True)
class VerifyOutput:
    """``token_ids[r]``: request ``r``'s emitted tokens (accepted drafts, then one
    recovered or bonus token), padded with ``PLACEHOLDER``; ``num_accepted[r]`` drafts
    of it were accepted (its emitted count is ``num_accepted + 1``)."""

    token_ids: torch.Tensor  # [R, max_k + 1] int64
    num_accepted: torch.Tensor  # [R] int64


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, max_k: int,
                     meta: SamplingMetadata) -> VerifyOutput:
    """Verify the drafts of ``R`` requests.

    ``logits``: ``[T, V]`` raw target logits, request ``r``'s ``num_drafts[r] + 1`` rows
    consecutive.  ``draft_ids``: ``[T]`` the draft each row verifies (the token after
    it), ``-1`` on each request's last (bonus) row.  ``meta``: one row per logits row
    (the request's parameters repeated; its generator shared by its rows; penalty and
    min_tokens rows counting the drafts before them).  ``max_k`` = ``max(num_drafts)``.
    """
    num_rows = logits.shape[0]
    is_draft = draft_ids >= 0
    safe_draft = draft_ids.clamp(min=0).unsqueeze(1)
    plain_greedy = (meta.all_greedy and meta.logit_bias is None and meta.penalties is None
                    and meta.min_tokens_mask is None and meta.constraints is None)
    if not plain_greedy:
        logits = Sampler.apply_logits_processors(logits.float(), meta)
    greedy = None if meta.all_random else _argmax(logits)
    if meta.all_greedy:
        assert greedy is not None
        token, accept = greedy, is_draft & (greedy == draft_ids)
    else:
        probs = _target_probs(logits, meta)
        p_draft = probs.gather(1, safe_draft).squeeze(1)
        u = torch.rand(num_rows, device=logits.device)
        for row, gen in meta.generators.items():
            u[row] = torch.rand(1, device=logits.device, generator=gen)[0]
        accept = is_draft & (u < p_draft)
        # Recovered token (where the draft is rejected): the residual, i.e. p with the
        # draft's mass removed (the race needs no normalisation).  On a bonus row
        # nothing is removed.
        residual = probs.scatter(1, safe_draft, torch.where(
            is_draft, torch.zeros_like(p_draft), p_draft).unsqueeze(1))
        token = random_sample(residual, meta.generators)
        if greedy is not None:
            assert meta.greedy_mask is not None
            token = torch.where(meta.greedy_mask, greedy, token)
            accept = torch.where(meta.greedy_mask, is_draft & (greedy == draft_ids), accept)
    return _assemble(token, accept, draft_ids, num_drafts, max_k)


def _target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution the ordinary sampler draws from (temperature, top-k/p, min-p)."""
    from pagedllm.sample.sampler import apply_min_p, apply_top_k_top_p

    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    return logits.softmax(dim=-1)


def _assemble(token: torch.Tensor, accept: torch.Tensor, draft_ids: torch.Tensor,
              num_drafts: torch.Tensor, max_k: int) -> VerifyOutput:
    """Per-row results -> per-request emitted tokens, as ``[R, max_k + 1]`` scatters."""
    width = max_k + 1
    dev = token.device
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    col = torch.arange(width, device=dev).unsqueeze(0)
    valid = col <= num_drafts.unsqueeze(1)  # [R, W]: the request's rows
    flat = (starts.unsqueeze(1) + col).clamp(max=token.shape[0] - 1)
    acc = accept[flat] & valid
    # Leading accepted drafts (a bonus row never accepts, so this is <= num_drafts).
    num_accepted = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)
    out = torch.where(col < num_accepted.unsqueeze(1), draft_ids[flat],
                      torch.full_like(flat, PLACEHOLDER))
    last = token.gather(0, starts + num_accepted)
    out = out.scatter(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    return VerifyOutput(token_ids=out, num_accepted=num_accepted)
