"""The model runner's structured-output work, behind one helper (``ModelRunner.grammar``).

::

    new request ──new_state──► GrammarState (matcher.py; None without a grammar)
    step N:   constrain      -> the sampled rows' token constraints: grammar bitmask,
                                allowed/bad tokens, logits processors
              draft_bitmask  -> a verify step's bitmask, one row per draft position
    after N:  advance / advance_verified -> every matcher follows its request's tokens

A row's next-token mask needs every token before it, so when the previous step's tokens
are still in flight (async scheduling) ``constrain`` and ``draft_bitmask`` wait for
them first (``wait_in_flight``): after this step's forward was launched, so the device
stays busy while the host advances the matchers and fills the bitmask (both batched:
``batch.py``).  The sampler applies the mask (``sample/token_constraints.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


def has_constraints(states: Sequence[Any]) -> bool:
    """Whether a request of ``states`` (the runner's ``CachedRequestState``) restricts
    its tokens: a grammar, allowed/bad tokens or logits processors."""
    return any(st.grammar is not None or st.params.allowed_token_ids
               or st.params.bad_words_token_ids or st.params.logits_processors
               for st in states)


class GrammarRunner:
    def __init__(self, vocab_size: int, device: torch.device, h2d: Any,
                 wait_in_flight: Callable[[], None]) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.h2d = h2d  # the runner's HostToDevice: pinned staging buffers, uploads
        self.wait_in_flight = wait_in_flight  # the tokens of the step still in flight
        # structured_output.backend.GrammarCompiler, set by the engine core on its first
        # structured-output request (its grammars are compiled before the request runs).
        self.compiler: Any = None
        self._grammars: Any = None  # batch.GrammarBatch, on first use
        self.bitmask_words = -(-vocab_size // 32)
        # Live requests with token constraints (grammar, allowed/bad tokens, logits
        # processors): while there are none, a step does not look for them.
        self._constrained: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether some live request has token constraints."""
        return bool(self._constrained)

    # -- requests ----------------------------------------------------------------------
    def new_state(self, params: SamplingParams, eos_token_id: int | None) -> Any:
        """A new matcher for a structured-output request (None for the others)."""
        so = params.structured_outputs
        if so is None:
            return None
        from pagedllm.worker.structured_output.matcher import GrammarState

        assert self.compiler is not None, "structured output without a compiler"
        stops = list(params.stop_token_ids or [])
        if eos_token_id is not None and not params.ignore_eos:
            stops.append(eos_token_id)
        return GrammarState(self.compiler.compile(so), stops, so.reasoning_end_token_ids)

    def add(self, st: Any) -> None:
        """A new request (``CachedRequestState``): tracked while it has constraints."""
        if has_constraints([st]):
            self._constrained.add(st.req_id)

    def fork(self, parent_req_id: str, child_req_id: str) -> None:
        if parent_req_id in self._constrained:
            self._constrained.add(child_req_id)

    def remove(self, req_id: str) -> None:
        self._constrained.discard(req_id)

    # -- step N ------------------------------------------------------------------------
    def constrain(self, smeta: Any, states: list[Any], in_flight: np.ndarray) -> Any:
        """``smeta`` (the step's ``SamplingMetadata``) with the token constraints of
        ``states`` (``sample/token_constraints.py``), unchanged when none has any.
        ``in_flight``: per state, whether its last token is still on the device."""
        if not has_constraints(states):
            return smeta
        from pagedllm.sample import token_constraints

        bitmask = None
        grammars = [st.grammar for st in states]
        if any(g is not None for g in grammars):
            if in_flight.any():
                self.wait_in_flight()
            # One row per sampled row (all-ones for rows without a grammar), so the
            # kernel needs no row indices; written in place into the pinned buffer.
            host = self.h2d.staging("grammar_bitmask", (len(states), self.bitmask_words),
                                    torch.int32)
            bitmask = self.h2d.upload(self._grammar_batch().fill(grammars, host), side=True)
        return dataclasses.replace(smeta, constraints=token_constraints.build(
            states, self.device, self.vocab_size, bitmask))

    def draft_bitmask(self, states: list[Any], drafts: list[list[int]],
                      in_flight: np.ndarray) -> Any:
        """A verify step's grammar bitmask (one row per verify row, each request's
        ``len(drafts) + 1`` consecutive: ``GrammarState.fill_drafts``), or None when no
        request has a grammar.  Like :meth:`constrain`, waits for the tokens of a step
        still in flight first (the masks follow every token)."""
        if not any(st.grammar is not None for st in states):
            return None
        if in_flight.any():
            self.wait_in_flight()
        host = self.h2d.staging("grammar_bitmask", (sum(len(d) + 1 for d in drafts),
                                                    self.bitmask_words), torch.int32)
        row = 0
        for st, d in zip(states, drafts):  # over requests; <= k + 1 rows each
            if st.grammar is None:
                host[row:row + len(d) + 1] = -1
            else:
                st.grammar.fill_drafts(host, row, d)
            row += len(d) + 1
        return self.h2d.upload(host[:row], side=True)

    # -- after step N ------------------------------------------------------------------
    def advance(self, states: Sequence[Any], tokens: Sequence[int]) -> None:
        """Each grammar of ``states`` accepts its request's new token (``tokens[i]``):
        every matcher in one xgrammar call."""
        if not self._constrained:
            return
        g_states, g_toks = [], []
        for st, t in zip(states, tokens):
            if st.grammar is not None:
                g_states.append(st.grammar)
                g_toks.append(t)
        if g_states:
            self._grammar_batch().advance(g_states, g_toks)

    def advance_verified(self, states: Sequence[Any], tokens: Sequence[list[int]]) -> None:
        """:meth:`advance` after a verify step, several tokens per request: in rounds
        (round j gives every request its j-th token, one xgrammar call a round, <= k + 1
        rounds)."""
        g_rounds: list[tuple[list[Any], list[int]]] = []
        for st, toks in zip(states, tokens):
            if st.grammar is not None:
                for j, t in enumerate(toks):  # <= k + 1
                    if j == len(g_rounds):
                        g_rounds.append(([], []))
                    g_rounds[j][0].append(st.grammar)
                    g_rounds[j][1].append(t)
        for g_states, g_toks in g_rounds:
            self._grammar_batch().advance(g_states, g_toks)

    def _grammar_batch(self) -> Any:
        if self._grammars is None:
            from pagedllm.worker.structured_output.batch import GrammarBatch

            self._grammars = GrammarBatch()
        return self._grammars
