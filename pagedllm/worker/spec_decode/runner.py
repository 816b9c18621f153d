"""The model runner's side of speculative decoding: one hook object,
:class:`SpecDecodeRunner` (``ModelRunner.spec``; None without speculation).

```
 step N:  scheduler ──► drafts of request r (SchedulerOutput.scheduled_spec_decode_tokens)
          runner:  write_drafts   -> the drafts become the row's input tokens after its
                                     last real token (the row's token count is not advanced)
                   target_states  -> EAGLE: the step's hidden states for the head
                   plan_verify    -> the drafts to verify (none when a sampled request needs
                                     the one-token sampler path: all rolled back)
                   verify         -> logits at the last k_r + 1 positions of r,
                                     rejection_sample: accepted drafts + 1 token per request
          runner._finish: record_verified -> append the emitted tokens;
                          propose_next    -> drafts for step N + 1 (n-gram lookup, a draft
                          model's k greedy steps, or an EAGLE head's, fed the target's
                          hidden states of step N)
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
from pagedllm.spec_decode.config import HIDDEN_STATE_METHODS, SpeculativeConfig
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.spec_decode.draft_model import DraftModelProposer
from pagedllm.worker.spec_decode.eagle_proposer import TargetStates
from pagedllm.worker.spec_decode.ngram import NgramProposer
from pagedllm.worker.spec_decode.rejection_sampler import rejection_sample
from pagedllm.worker.structured_output.runner import GrammarRunner


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


class SpecDecodeRunner:
    """Owns the drafts' device side for one model runner: writes them into the batch,
    verifies them by rejection sampling and proposes the next ones (module doc).  The
    model runner calls it at the named points of its step and nowhere else."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, batch: InputBatch,
                 h2d: Any, device: torch.device, vocab_size: int,
                 grammar: GrammarRunner) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # The model runner's InputBatch, HostToDevice and grammar helper
        # (worker/structured_output/runner.py: a grammar constrains every verify row).
        self.batch = batch
        self.h2d = h2d
        self.device = device
        self.vocab_size = vocab_size
        self.grammar = grammar
        self.proposer = NgramProposer(config.num_speculative_tokens,
                                      config.prompt_lookup_min, config.prompt_lookup_max)
        # methods "draft_model", "eagle", "eagle3", "mtp": set by the worker once the
        # draft's KV is allocated.
        self.draft: DraftModelProposer | None = None

    def forget(self, req_id: str) -> None:
        """The request's draft-side state is stale (it left the batch, or a block of it
        was copied on write)."""
        if self.draft is not None:
            self.draft.forget(req_id)

    # -- step N: inputs -----------------------------------------------------------
    def write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Put each request's drafts after its last token in its row (input ids for
        the forward); the row's token count stays (they are not its tokens yet)."""
        token_ids, num_tokens, row_of = (self.batch.token_ids, self.batch.num_tokens,
                                         self.batch.row_of)
        for rid, d in drafts.items():
            row = row_of[rid]
            n = int(num_tokens[row])
            token_ids[row, n:n + len(d)] = d

    # -- step N: after the forward -------------------------------------------------------
    def target_states(self, model: Any, inp: Any, order: list[str], rows: np.ndarray,
                      num_computed: np.ndarray, num_new: np.ndarray, hidden: torch.Tensor,
                      sampling: np.ndarray) -> TargetStates | None:
        """EAGLE (``eagle_proposer.py``): the step's hidden states as the head reads them
        -- the model output, or for EAGLE-3 the aux states the model recorded
        (``LlamaModel.aux_buffer``) -- with each request's first row, its position and
        row count; kept for :meth:`propose_next`, and fed to the head now for requests
        that do not sample (prompt chunks).  None for the other proposers.  Device
        tensors only: no sync."""
        if not self.wants_target_states:
            return None
        aux = getattr(getattr(model, "model", None), "aux_buffer", None)
        states = hidden if aux is None else aux[:len(inp.input_ids)]
        starts = inp.query_start_loc[:-1].tolist()
        target = TargetStates(states, {r: (starts[i], int(num_computed[i]), int(num_new[i]))
                                       for i, r in enumerate(order)})
        chunks = np.flatnonzero(~sampling)
        if len(chunks):
            self.observe(rows[chunks].tolist(), [order[i] for i in chunks], target)
        return target

    def plan_verify(self, order: Sequence[str], drafts: dict[str, list[int]],
                    sample_idx: np.ndarray, states: list[Any], last_row: np.ndarray,
                    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The drafts of each sampled request to verify (``k``; request ``i`` is
        ``order[sample_idx[i]]``) and the row of its last token, ``last_row``.  When a
        sampled request needs the one-token sampler path (:meth:`verifiable`), ``k`` is
        None: every draft is rolled back and each request samples after its real last
        token."""
        k = np.fromiter((len(drafts.get(r, ())) for r in order), np.int64,
                        len(order))[sample_idx]
        if not self.verifiable(states):
            return None, last_row - k
        return k, last_row

    def verifiable(self, states: list[Any]) -> bool:
        """Whether a step's drafts can be verified: not while a sampled request needs
        the one-token sampler path (logprobs, token constraints other than a grammar,
        or a grammar a reasoning parser has yet to switch on)."""
        return not any(st.params.logprobs is not None for st in states) and not (
            self.grammar.active and any(
                st.params.allowed_token_ids or st.params.bad_words_token_ids
                or st.params.logits_processors
                or (st.grammar is not None and st.grammar.reasoning_end)
                for st in states))

    @staticmethod
    def logits_rows(query_end: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Hidden-state rows of the last ``k[i] + 1`` positions of each sampled request
        (``query_end[i]``: one past its last row), concatenated in order."""
        counts = k + 1
        starts = query_end - counts
        offs = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(starts, counts) + offs

    def verify(self, model: Any, hidden: torch.Tensor, last_row: np.ndarray, k: np.ndarray,
               states: list[Any], drafts: dict[str, list[int]],
               in_flight: np.ndarray) -> torch.Tensor:
        """The step's tokens for the sampled ``states`` (``[R, max(k) + 1]``,
        PLACEHOLDER-padded): their drafts rejection-sampled against the target's logits
        at each request's last ``k[i] + 1`` rows.  A request with a grammar gets one
        bitmask row per verify row (``GrammarState.fill_drafts``; all ones for requests
        without one), applied to the target's logits before verification, so a draft
        the grammar forbids is rejected and the distribution sampled is the constrained
        one -- as without speculation.  ``in_flight``: see ``GrammarRunner``."""
        logits = model.compute_logits(hidden[self.h2d(
            "logits_idx", self.logits_rows(last_row + 1, k))])
        step_drafts = [drafts.get(st.req_id, []) for st in states]
        grammar_bitmask = self.grammar.draft_bitmask(states, step_drafts, in_flight)
        views: list[Any] = []
        flat: list[int] = []
        for st, d in zip(states, step_drafts):
            reads = _reads_output(st.params)
            for j in range(len(d) + 1):  # over <= k + 1 verify rows, not over tokens
                views.append(_PositionView(
                    st, st.output_token_ids + d[:j] if reads and j else st.output_token_ids))
            flat.extend(d)
            flat.append(-1)
        meta = SamplingMetadata.build(views, self.device, self.vocab_size)
        if grammar_bitmask is not None:
            from pagedllm.sample import token_constraints

            meta = dataclasses.replace(meta, constraints=token_constraints.build(
                views, self.device, self.vocab_size, grammar_bitmask))
        draft_ids = self.h2d("spec_drafts", np.asarray(flat, dtype=np.int64))
        num = self.h2d("spec_num", k)
        return rejection_sample(logits, draft_ids, num, int(k.max()) if len(k) else 0,
                                meta).token_ids

    # -- after step N: drafts for step N + 1 -------------------------------------------
    def record_verified(self, handle: Any, tokens: list[list[int]]) -> None:
        """``ModelRunner._finish`` for a verify step (``handle``: its ``StepHandle``):
        several tokens per request, ``tokens[i]`` PLACEHOLDER-padded."""
        assert handle.sample_idx is not None
        batch = self.batch
        emitted = []
        for i, st, row_toks in zip(handle.sample_idx, handle.states, tokens):
            toks = [t for t in row_toks if t >= 0]
            emitted.append(toks)
            st.output_token_ids.extend(toks)
            handle.out.sampled_token_ids[i] = toks
            row = batch.row_of.get(st.req_id)
            if row is not None:
                n = int(batch.num_tokens[row])
                batch.token_ids[row, n:n + len(toks)] = toks
                batch.num_tokens[row] = n + len(toks)
        self.grammar.advance_verified(handle.states, emitted)

    def propose_next(self, handle: Any) -> None:
        """Drafts for the next step of the requests that just sampled (``handle``: the
        step's ``StepHandle``), into its output."""
        live = [(self.batch.row_of[st.req_id], st) for st in handle.states
                if st.req_id in self.batch.row_of]
        # Only as many as the scheduler's policy expects to verify (often none at large
        # batch): proposing costs host (n-gram) or device (draft model) time.  Seeded
        # requests get theirs always (SpecScheduling.take).  An EAGLE head reads the
        # step's states for every request even when nothing is proposed (a cap of 0
        # writes its KV only): its KV must follow the target.
        k = handle.num_spec_proposals
        proposing = live
        if k <= 0 and handle.target_states is None:
            proposing = [(row, st) for row, st in live if st.params.seed is not None]
        if proposing:
            rows, states = zip(*proposing)
            props = self.propose(list(rows), states, k, handle.target_states)
            handle.out.spec_token_ids = {st.req_id: d for st, d in zip(states, props) if d}
        handle.target_states = None  # the proposer is done with them

    @property
    def wants_target_states(self) -> bool:
        """Whether the proposer reads the target step's hidden states (EAGLE heads, a
        DeepSeek MTP layer)."""
        return self.config.method in HIDDEN_STATE_METHODS

    def observe(self, rows: Sequence[int], req_ids: Sequence[str], target: Any) -> None:
        """EAGLE: write the head KV of a step's rows for requests that get no drafts
        from it (``EagleProposer.observe``)."""
        if self.draft is not None and target is not None:
            self.draft.observe(self.batch, rows, req_ids, self.h2d,  # type: ignore[attr-defined]
                               target)

    def propose(self, rows: list[int], states: Sequence[Any], k: int,
                target: Any = None) -> list[list[int]]:
        """Drafts for the requests ``states`` (rows ``rows`` of the runner's
        ``InputBatch``): at most ``k`` (the policy's count; a seeded request always gets
        up to num_speculative_tokens, see ``SpecScheduling.take``), and never past
        ``max_tokens`` or the context (the bonus token needs a slot too).  ``target``:
        the step's ``TargetStates`` (EAGLE)."""
        batch = self.batch
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
            return self.draft.propose(batch, rows, [st.req_id for st in states], caps,
                                      self.h2d, target)
        return self.proposer.propose(token_ids, num_tokens, rows, caps)
