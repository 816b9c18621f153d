"""Structured outputs constrain drafts too: a grammar request gets n-gram drafts, each
verify position is masked as if the drafts before it had been accepted
(``GrammarState.fill_drafts``), and greedy output equals decoding without speculation,
token for token, on the default SmolLM2 model -- with drafts verified and accepted (the
prompts ask to copy JSON, so prompt lookup finds it)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams as SO
from tests.spec_decode.flat_cost import pin_flat_step_cost

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "city": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}
RECORDS = ['{"name": "Alice Martin", "city": "Lyon", "age": 34}',
           '{"name": "Bob Stone", "city": "Leeds", "age": 51}']
PROMPTS = [f"Copy this JSON record exactly, nothing else:\n{r}\nCopy:\n" for r in RECORDS]


@pytest.fixture(scope="module")
def spec_llm():
    llm = LLM(kv_cache_memory_bytes=32 << 20, max_model_len=256, quantization="none",
              max_num_batched_tokens=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3})
    pin_flat_step_cost(llm, 4)
    return llm


def _params(**kw: object) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=40,
                           structured_outputs=SO(json=SCHEMA, **kw)),
            SamplingParams(temperature=0.0, max_tokens=40,
                           structured_outputs=SO(regex=r"\{\"name\": \"[A-Za-z ]+\", .*")),
            SamplingParams(temperature=0.0, max_tokens=24)]  # no grammar, same batch


def test_grammar_requests_speculate_and_match_no_speculation(llm, spec_llm):
    spec = spec_llm.llm_engine.client.core.scheduler.spec
    # Grammar requests alone: their own drafts are verified and kept.
    want = llm.generate(PROMPTS, _params()[:2], use_tqdm=False)
    before = spec.total_accepted_tokens
    got = spec_llm.generate(PROMPTS, _params()[:2], use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.total_accepted_tokens > before
    # Beside a request without a grammar, in one batch.
    prompts = PROMPTS + PROMPTS[:1]
    want = llm.generate(prompts, _params(), use_tqdm=False)
    got = spec_llm.generate(prompts, _params(), use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    record = json.loads(got[0].outputs[0].text)
    assert set(record) == {"name", "city", "age"} and isinstance(record["age"], int)


def test_fill_drafts_masks_each_position_as_if_the_drafts_were_accepted(llm):
    """Position j's row equals the mask after accepting drafts[:j] one by one; a draft
    the grammar refuses is masked out at its own position; the matcher is unchanged."""
    from pagedllm.worker.structured_output.matcher import GrammarState

    runner = llm.llm_engine.client.core.executor.worker.runner
    tok = llm.get_tokenizer()
    st = GrammarState(runner.grammar.compiler.compile(SO(json=SCHEMA)),
                      [tok.eos_token_id])
    good = tok.encode(RECORDS[0], add_special_tokens=False)[:5]
    words = runner.grammar.bitmask_words
    got = torch.zeros(len(good) + 1, words, dtype=torch.int32)
    st.fill_drafts(got, 0, good)
    want = torch.zeros_like(got)
    ref = GrammarState(st.compiled, [tok.eos_token_id])
    for j in range(len(good) + 1):
        ref.fill(want, j)
        if j < len(good):
            ref.advance(good[j])
    assert torch.equal(got, want)
    assert not ref.failed
    # The state did not move: filling again gives the same first row.
    again = torch.zeros(1, words, dtype=torch.int32)
    st.fill(again, 0)
    assert torch.equal(again[0], got[0])
    # A refused draft ("x" cannot start a JSON object): masked out where it stands.
    bad = tok.encode("x", add_special_tokens=False)[:1]
    rows = torch.zeros(3, words, dtype=torch.int32)
    st.fill_drafts(rows, 0, bad + good[:1])
    t = bad[0]
    assert not (int(rows[0, t // 32]) >> (t % 32)) & 1
