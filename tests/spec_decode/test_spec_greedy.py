"""Greedy decoding with n-gram speculation is token for token decoding without it, on
the default SmolLM2 model: batched, n > 1, under preemption and with prefix-cache hits;
the prompts are input-grounded so that drafts do get accepted (the test is not vacuous)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.spec_decode.flat_cost import pin_flat_step_cost

TEXT = ("The library opens at nine in the morning and closes at six in the evening. "
        "Visitors may borrow up to five books at a time for three weeks.")
# A shared first part (prefix-cache hits within the batch), then the instruction.
PROMPTS = [f"Text: {TEXT}\n{task}" for task in (
    "Repeat the text above exactly:", "Copy the note above word for word:",
    "Rewrite the text above without changing it:")]


@pytest.fixture(scope="module")
def spec_llm():
    # A KV cache of ~9 blocks: the four sequences do not fit at once (preemption).
    llm = LLM(kv_cache_memory_bytes=7 << 20, max_model_len=128,
              max_num_batched_tokens=256, quantization="none",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3})
    pin_flat_step_cost(llm, 4)
    return llm


def test_greedy_identical_batched_preempted_prefix_hits(llm, spec_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.2)]
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    got = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
    sched = spec_llm.llm_engine.client.core.scheduler
    assert sched.total_preemptions > 0
    assert sched.spec.total_accepted_tokens > 0
    assert any(g.num_cached_tokens > 0 for g in got)


def test_seeded_sampling_with_speculation_is_reproducible(spec_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    a = spec_llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = spec_llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 12
