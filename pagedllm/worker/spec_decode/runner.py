"""The model runner's side of speculative decoding, behind three small hooks.

```
 step N:  scheduler ──► drafts of request r (SchedulerOutput.scheduled_spec_decode_tokens)
          runner:  write_drafts  -> the drafts become the row's input tokens after its last
                                    real token (the row's token count is not advanced)
                   logits_rows   -> hidden rows of the last k_r + 1 positions of r
                   verify        -> rejection_sample: accepted drafts + 1 token per request
          runner._finish: append the emitted tokens; propose -> drafts for step N + 1
                          (n-gram lookup, a draft model's k greedy steps, or an EAGLE
                          head's, fed the target's hidden states of step N)
 scheduler: rolls num_computed_tokens back by the rejected drafts (their KV slots are
            simply overwritten later; nothing is copied or freed)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.worker.spec_decode.draft_model import DraftModelProposer
from pagedllm.worker.spec_decode.ngram import NgramProposer
from pagedllm.worker.spec_decode.rejection_sampler import VerifyOutput, rejection_sample


class _PositionView:
    """One verify row of a request: its parameters and generator, and as output the
    request's tokens plus the drafts before this row (what penalties and min_tokens
    would have seen had the drafts been decoded one by one)."""

    __slots__ = ("params", "generator", "prompt_token_ids", "output_token_ids",
                 "eos_token_id")

    def __init__(self, st: Any, output: list[int]) -> None:
        self.params: SamplingParams = st.params
        self.generator = st.generator
        self.prompt_token_ids = st.prompt_token_ids
        self.output_token_ids = output
        self.eos_token_id = st.eos_token_id


def _reads_output(p: SamplingParams) -> bool:
    return bool(p.min_tokens or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


def can_speculate(params: SamplingParams) -> bool:
    """Requests that get drafts: not those reporting per-token logprobs, beams, or
    token constraints other than a grammar (allowed/bad words, logits processors): those
    read one token per step.  A grammar constrains every verify position
    (``GrammarState.fill_drafts``), except one a reasoning parser switches on mid-output
    (the switch could fall inside the drafts)."""
    so = params.structured_outputs
    return (params.logprobs is None and not params.use_beam_search
            and (so is None or not so.reasoning_end_token_ids)
            and not params.allowed_token_ids
            and not params.bad_words_token_ids and not params.logits_processors)


class SpecDecodeHook:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens,
                                      config.prompt_lookup_min, config.prompt_lookup_max)
        # methods "draft_model", "eagle", "eagle3": set by the worker once the draft's KV
        # is allocated.
        self.draft: DraftModelProposer | None = None

    def forget(self, req_id: str) -> None:
        """The request's draft-side state is stale (it left the batch, or a block of it
        was copied on write)."""
        if self.draft is not None:
            self.draft.forget(req_id)

    # -- step N: inputs -----------------------------------------------------------
    @staticmethod
    def write_drafts(token_ids: np.ndarray, num_tokens: np.ndarray,
                     row_of: dict[str, int], drafts: dict[str, list[int]]) -> None:
        """Put each request's drafts after its last token in its row (input ids for
        the forward); the row's token count stays (they are not its tokens yet)."""
        for rid, d in drafts.items():
            row = row_of[rid]
            n = int(num_tokens[row])
            token_ids[row, n:n + len(d)] = d

    @staticmethod
    def num_drafts(order: Sequence[str], drafts: dict[str, list[int]]) -> np.ndarray:
        return np.fromiter((len(drafts.get(r, ())) for r in order), np.int64, len(order))

    @staticmethod
    def logits_rows(query_end: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Hidden-state rows of the last ``k[i] + 1`` positions of each sampled request
        (``query_end[i]``: one past its last row), concatenated in order."""
        counts = k + 1
        starts = query_end - counts
        offs = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(starts, counts) + offs

    def verify(self, logits: torch.Tensor, states: Sequence[Any],
               drafts: Sequence[list[int]], k: np.ndarray, device: torch.device,
               vocab_size: int, to_device: Any,
               grammar_bitmask: torch.Tensor | None = None) -> VerifyOutput:
        """Rejection-sample the step's ``states`` (``drafts[i]``: request i's drafts).
        ``grammar_bitmask``: one row per verify row (``GrammarState.fill_drafts``; all
        ones for requests without a grammar), applied to the target's logits before
        verification, so a draft the grammar forbids is rejected and the distribution
        sampled is the constrained one -- as without speculation."""
        views: list[Any] = []
        flat: list[int] = []
        for st, d in zip(states, drafts):
            reads = _reads_output(st.params)
            for j in range(len(d) + 1):  # over <= k + 1 verify rows, not over tokens
                views.append(_PositionView(
                    st, st.output_token_ids + d[:j] if reads and j else st.output_token_ids))
            flat.extend(d)
            flat.append(-1)
        meta = SamplingMetadata.build(views, device, vocab_size)
        if grammar_bitmask is not None:
            from pagedllm.sample import token_constraints

            meta = dataclasses.replace(meta, constraints=token_constraints.build(
                views, device, vocab_size, grammar_bitmask))
        draft_ids = to_device("spec_drafts", np.asarray(flat, dtype=np.int64))
        num = to_device("spec_num", k)
        return rejection_sample(logits, draft_ids, num, int(k.max()) if len(k) else 0, meta)

    # -- after step N: drafts for step N + 1 -------------------------------------------
    @property
    def wants_target_states(self) -> bool:
        """Whether the proposer reads the target step's hidden states (EAGLE heads)."""
        return self.config.method in ("eagle", "eagle3")

    def observe(self, batch: Any, rows: Sequence[int], req_ids: Sequence[str], h2d: Any,
                target: Any) -> None:
        """EAGLE: write the head KV of a step's rows for requests that get no drafts
        from it (``EagleProposer.observe``)."""
        if self.draft is not None and target is not None:
            self.draft.observe(batch, rows, req_ids, h2d, target)  # type: ignore[attr-defined]

    def propose(self, batch: Any, rows: list[int], states: Sequence[Any],
                h2d: Any, k: int, target: Any = None) -> list[list[int]]:
        """Drafts for the requests ``states`` (rows ``rows`` of the runner's
        ``InputBatch``): at most ``k`` (the policy's count; a seeded request always gets
        up to num_speculative_tokens, see ``SpecScheduling.take``), and never past
        ``max_tokens`` or the context (the bonus token needs a slot too).  ``target``:
        the step's ``TargetStates`` (EAGLE)."""
        token_ids, num_tokens = batch.token_ids, batch.num_tokens
        caps = []
        full = self.config.num_speculative_tokens
        for row, st in zip(rows, states):
            p = st.params
            if not can_speculate(p):
                caps.append(0)
                continue
            left_out = (p.max_tokens or 0) - len(st.output_token_ids) - 1
            left_ctx = self.max_model_len - int(num_tokens[row]) - 1
            caps.append(min(left_out, left_ctx, full if p.seed is not None else k))
        if self.draft is not None:
            return self.draft.propose(batch, rows, [st.req_id for st in states], caps, h2d,
                                      target)
        return self.proposer.propose(token_ids, num_tokens, rows, caps)
