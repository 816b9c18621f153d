"""The sampler: logits of one step -> next token per row (+ optional logprobs).

Stages, in vLLM's order (each skipped when :class:`SamplingMetadata` says no row uses it)::

    raw logprobs = log_softmax(logits)           only if some row asked for logprobs
    logit_bias   -> min_tokens mask -> repetition / frequency / presence penalties
    greedy rows: argmax                          (all-greedy batch stops here)
    random rows: / temperature -> top-k -> top-p -> min-p -> softmax
                 -> argmax(probs / q), q ~ Exp(1)  (the "exponential race")

``argmax(p_i / q_i)`` with i.i.d. ``q_i ~ Exp(1)`` picks ``i`` with probability ``p_i``
(``q_i / p_i ~ Exp(p_i)``, and the smallest of independent exponentials is ``i`` with
probability ``p_i / sum p``).  Unlike ``torch.multinomial`` it needs no cumulative sum, and
it lets a seeded row draw its ``q`` from its own generator: its samples then depend only on
its own logits and seed, whatever else is in the batch.

No stage calls ``.item()``/``.tolist()``: the runner does its one device->host copy after
the sampler (:meth:`LogprobsTensors.tolists` is that copy for logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.metadata import PenaltyTensors, SamplingMetadata


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum).  On CUDA the vocabulary is split over many
    programs (``kernels.sampling.sample_tokens``): torch's argmax reduces one row with a
    single block, ~27 us for a 128k vocabulary at batch 1 on an H200."""
    if logits.is_cuda:
        from pagedllm.kernels.sampling import sample_tokens

        return sample_tokens(logits, None)
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs for ``N`` positions, ``k`` alternatives each.

    Column 0 of ``token_ids``/``logprobs`` is the chosen token (sampled, or the prompt's
    next token for prompt logprobs); columns ``1..k`` are the ``k`` most likely tokens,
    most likely first.  ``ranks[i]`` is the chosen token's rank: the number of tokens at
    least as likely as it (1 = most likely).  ``k`` is the batch maximum; a row that asked
    for fewer keeps only its first ``1 + its_k`` columns.
    """

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Copy to host (a device sync: call it at the runner's one host-copy point)."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass(frozen=True)
class SamplerOutput:
    """The step's result: one token per row, and logprobs when any row asked for them."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    k: int) -> LogprobsTensors:
    """Pick the chosen token's logprob and rank and the top-``k`` from ``[N, V]`` logprobs."""
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    # ">=" counts the chosen token itself, so the top token has rank 1 (vLLM's convention;
    # ties share the worse rank).
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        chosen_ids = torch.cat([chosen_ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_vals], dim=1)
    return LogprobsTensors(token_ids=chosen_ids, logprobs=chosen, ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> LogprobsTensors:
    """Prompt logprobs: ``logits[i]`` is the model's distribution for ``target_ids[i]``.

    ``logits`` ``[M, V]`` are the raw model outputs at the prompt positions (position ``j``
    predicts prompt token ``j + 1``); no sampling parameter applies (vLLM semantics).
    """
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, k)


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """Return ``logits`` with the penalised rows rewritten (OpenAI / vLLM definitions).

    For a penalised row and token ``t`` with output count ``c_t``:
    repetition ``r`` (``t`` in prompt or output): ``x / r`` if ``x > 0`` else ``x * r``;
    then frequency ``f``: ``x - f * c_t``; then presence ``p``: ``x - p * [c_t > 0]``.
    """
    sub = logits.index_select(0, pen.rows)
    counts = pen.output_counts
    in_output = counts > 0
    rep = pen.repetition.unsqueeze(1)
    seen = pen.prompt_mask | in_output
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - pen.frequency.unsqueeze(1) * counts.to(sub.dtype)
    sub = sub - pen.presence.unsqueeze(1) * in_output.to(sub.dtype)
    return logits.index_copy(0, pen.rows, sub)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to ``-inf``) tokens outside each row's top-k, then outside its top-p nucleus.

    Top-k keeps every token whose logit is ``>=`` the k-th largest (ties at the boundary
    are all kept).  Top-p keeps the smallest most-likely-first prefix whose probability
    (after top-k) reaches ``p``; the most likely token is always kept.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        # topk(max k) is much cheaper than a full sort when every k is small.
        top_vals = logits.topk(max_top_k, dim=-1).values
        kth = top_vals.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= vocab).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    # Both (or only top-p): one ascending sort serves both.
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Ascending: a token goes when everything up to and including it is <= 1 - p, i.e. the
    # more likely tokens above it already hold >= p of the mass.
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * (max probability)`` of the row."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs`` ``[N, V]`` by the exponential race.

    Rows in ``generators`` draw their noise from their own generator (one loop iteration
    per seeded row), so they are reproducible independently of the batch.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax treats as largest,
    # and could pick a masked (probability 0) token.  A tiny floor keeps 0 / q == 0.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


class Sampler(nn.Module):
    """Turns ``[N, V]`` logits into ``N`` next tokens; see the module docstring for stages.

    ``logits`` is not modified.  Deterministic for greedy rows and for rows with a
    generator; greedy rows return the argmax of the *processed* logits (bias, min_tokens
    and penalties applied), like vLLM.
    """

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if (meta.all_greedy and meta.max_num_logprobs is None and meta.logit_bias is None
                and meta.min_tokens_mask is None and meta.penalties is None
                and meta.constraints is None):
            # Plain greedy: the argmax of the logits as they come (bf16 on a GPU).  Every
            # bf16/fp16 value is exact in fp32, so this is the token the fp32 path would
            # pick (first maximum on ties), without writing and re-reading an fp32 copy
            # of [N, vocab] (~50 us per step at 250 rows of a 128k vocabulary).
            return SamplerOutput(sampled_token_ids=_argmax(logits), logprobs=None)
        owned = logits.dtype != torch.float32  # float() makes a copy we may write to
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if meta.max_num_logprobs is not None else None)

        logits = self.apply_logits_processors(logits, meta, owned)
        greedy_ids = None if meta.all_random else _argmax(logits)
        if meta.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            sampled = self.sample_random(logits, meta)
            if greedy_ids is not None:
                assert meta.greedy_mask is not None
                sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)

        logprobs = None
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata,
                                owned: bool = False) -> torch.Tensor:
        """logit_bias, the min_tokens mask, penalties, then the token constraints
        (out of place; ``owned``: ``logits`` is the caller's private copy, which the
        in-place grammar mask may write to)."""
        given = logits
        if meta.logit_bias is not None:
            b = meta.logit_bias
            assert b.values is not None
            logits = logits.index_put((b.rows, b.token_ids), b.values, accumulate=True)
        if meta.min_tokens_mask is not None:
            m = meta.min_tokens_mask
            logits = logits.index_put((m.rows, m.token_ids),
                                      logits.new_full((), float("-inf")))
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        if meta.constraints is not None:  # grammars, allowed/bad tokens, processors
            from pagedllm.sample.token_constraints import apply as apply_constraints

            logits = apply_constraints(logits, meta.constraints,
                                       owned=owned or logits is not given)
        return logits

    @staticmethod
    def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race (all rows)."""
        assert meta.temperature is not None
        logits = logits / meta.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        return random_sample(logits.softmax(dim=-1), meta.generators)
