"""The runner's batched grammar work (``worker/structured_output/batch.py``) against the
per-request path it replaces (``GrammarState.advance`` / ``fill_bitmask``), with real
xgrammar matchers on the default model's tokenizer and a model vocabulary padded past
the tokenizer's (not a multiple of 32, so a bitmask word straddles the boundary)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

PERSON = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"type": "integer"}}}}


def _allowed(row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def test_batched_advance_and_fill_match_the_per_request_path(
        hf_default_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.structured_output.backend import GrammarCompiler, tokenizer_size
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO
    from pagedllm.worker.structured_output import batch
    from pagedllm.worker.structured_output.batch import GrammarBatch
    from pagedllm.worker.structured_output.matcher import GrammarState, fill_bitmask

    tok = hf_default_tokenizer
    n_tok = tokenizer_size(tok)
    vocab = n_tok + 1000 + 7  # the model pads its embedding past the tokenizer
    compiler = GrammarCompiler(lambda: tok, vocab)
    eos = tok.eos_token_id
    end = tok("</think>", add_special_tokens=False).input_ids
    specs = [None, SO(json=PERSON), SO(regex="[a-z]{2,6}"), SO(choice=["yes", "no"]),
             SO(json=PERSON, reasoning_end_token_ids=end), SO(regex="[0-9]+")]
    compiled = [compiler.compile(so) if so is not None else None for so in specs]
    # Compiled for the tokenizer's vocabulary: no padding ids registered as special.
    assert compiled[1].tokenizer_info.vocab_size == n_tok
    assert len(compiled[1].tokenizer_info.special_token_ids) < 100

    def states() -> list[GrammarState | None]:
        return [None if c is None else GrammarState(c, [eos], so.reasoning_end_token_ids)
                for c, so in zip(compiled, specs)]

    batched, ref = states(), states()
    monkeypatch.setattr(batch, "MIN_THREADED_ROWS", 1)  # xgrammar's threads, 5 rows
    gb = GrammarBatch(max_threads=2)
    width = -(-vocab // 32)
    out = torch.full((len(specs) + 2, width), 7, dtype=torch.int32)  # stale contents
    rng = random.Random(0)
    think = tok("Hmm", add_special_tokens=False).input_ids + end
    for step in range(14):
        got = gb.fill(batched, out)
        want = fill_bitmask(ref, vocab)
        assert torch.equal(got, want), step
        assert bool((got[0] == -1).all())  # no grammar: every token
        for i in (1, 2, 3, 5):  # a grammar never allows a padding id
            assert _allowed(got[i], vocab).max() < n_tok
        toks = []
        for i in range(len(specs)):
            ok = _allowed(want[i], vocab)
            toks.append(rng.choice(ok.tolist()) if len(ok) else eos)
        if step < len(think):  # row 4 reasons first; its grammar starts after </think>
            toks[4] = think[step]
        if step == 0:
            toks[5] = tok("zzz", add_special_tokens=False).input_ids[0]  # not a digit
        pairs = [(b, r, t) for b, r, t in zip(batched, ref, toks) if b is not None]
        gb.advance([b for b, _, _ in pairs], [t for _, _, t in pairs])
        for b, r, t in pairs:
            assert r is not None
            r.advance(t)
            assert (b.num_seen, b.num_accepted, b.failed, b.active, b.ended) == \
                (r.num_seen, r.num_accepted, r.failed, r.active, r.ended)
            assert b.ended == b.matcher.is_terminated()  # tracked without asking
    assert batched[5] is not None and batched[5].failed  # the rejected token
    assert batched[4] is not None and batched[4].active and batched[4].num_accepted > 0
    assert batched[3] is not None and batched[3].ended  # "yes"/"no", then EOS
    assert gb.num_fills == 14 and gb.fill_s > 0 and gb.advance_s > 0
