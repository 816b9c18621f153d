"""Async scheduling (step N+1 scheduled before step N's tokens are read back) changes
nothing observable: greedy, seeded and stop-string outputs equal the synchronous engine's,
also under preemption, and an idle engine holds no step in flight and no block."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,", "The capital of France is", "Write a haiku:"]
# 10 usable blocks of 16 tokens: six requests of up to 62 tokens (16 blocks) must preempt.
BYTES_PER_BLOCK = 16 * 2 * 30 * 3 * 64 * 4


def _run(async_scheduling: bool) -> tuple[list, list, str, int]:
    llm = LLM(kv_cache_memory_bytes=11 * BYTES_PER_BLOCK, max_model_len=128,
              async_scheduling=async_scheduling)
    greedy = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                    for n in (40, 7, 33, 21, 48, 12)], use_tqdm=False)
    seeded = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=5, max_tokens=20),
                          use_tqdm=False)
    # min_tokens masks EOS by the count of generated tokens, the in-flight one included
    # (it does not make the engine synchronous).  EOS is pushed up so that it is chosen
    # the moment the mask lifts: a miscount shows as a different length.
    eos = llm.get_tokenizer().eos_token_id
    seeded += llm.generate(PROMPTS, SamplingParams(temperature=0, min_tokens=12,
                                                   max_tokens=30, logit_bias={eos: 50.0}),
                           use_tqdm=False)
    (stop,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30,
                                                       stop=["brown bear"]), use_tqdm=False)
    core = llm.llm_engine.client.core
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_usable_blocks
    return ([o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in seeded],
            stop.outputs[0].text, core.scheduler.total_preemptions)


@pytest.fixture(scope="module")
def sync_run(default_model_path):
    return _run(False)


def test_async_equals_sync(sync_run):
    got = _run(True)
    assert got[0] == sync_run[0]
    assert [len(t) for t in got[0]] == [40, 7, 33, 21, 48, 12]
    assert got[1] == sync_run[1]
    assert [len(t) for t in got[1][len(PROMPTS):]] == [13] * len(PROMPTS)  # 12 + EOS
    assert got[2] == sync_run[2]
    assert got[3] > 0 and sync_run[3] > 0  # both were preempted
