"""Greedy output equals Hugging Face Transformers token for token (fp32, CPU) on the real
SmolLM2-135M-Instruct GGUF: one at a time, all together with staggered lengths, and
under a KV pool so small that requests are preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 48
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    ids = [llm.llm_engine.input_processor.apply_chat_template([{"role": "user", "content": c}])
           for c in CHAT]
    ids += [tok(r).input_ids for r in RAW]
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_default_model, prompts) -> list[list[int]]:
    model = hf_default_model
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 top_p=None, top_k=None, temperature=None)
            refs.append(out[0, len(p):].tolist())
    return refs


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time(llm, prompts, hf_reference):
    for p, ref in zip(prompts, hf_reference):
        (out,) = llm.generate([p], _greedy(NEW_TOKENS), use_tqdm=False)
        assert out.outputs[0].token_ids == ref
        assert out.prompt_token_ids == p


def test_batched_with_staggered_lengths(llm, prompts, hf_reference):
    lengths = [NEW_TOKENS, 7, 30, NEW_TOKENS, 12, 41, 3, 25]
    outs = llm.generate(prompts, [_greedy(n) for n in lengths], use_tqdm=False)
    for got, ref, n in zip(_ids(outs), hf_reference, lengths):
        assert got == ref[:n]


def test_preempted_equals_not_preempted(default_model_path, prompts, hf_reference):
    # 24 blocks of 16 tokens: far fewer than 8 requests of 50-90 tokens need at once.
    mc_bytes_per_block = 16 * 2 * 30 * 3 * 64 * 4
    small = LLM(kv_cache_memory_bytes=24 * mc_bytes_per_block, max_model_len=256,
                quantization="none")
    outs = small.generate(prompts, _greedy(NEW_TOKENS), use_tqdm=False)
    assert small.llm_engine.client.core.scheduler.total_preemptions > 0
    assert _ids(outs) == hf_reference
    pool = small.llm_engine.client.core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
