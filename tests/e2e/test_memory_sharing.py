"""Memory sharing on the real default model (CPU, fp32): greedy outputs are identical with
prefix caching on and off and with swap or recompute preemption on a tiny pool; a shared
prefix is reported as cache hits; n > 1 samples computed from one shared prompt equal
independently seeded requests; beam search equals Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams

SYSTEM = ("You are a concise assistant. Answer in one short sentence and never use "
          "lists. Question: ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "What do bees make?", "Name a prime number."]
NEW = 12
BLOCK_BYTES = 16 * 46080  # SmolLM2-135M, fp32: 30 layers x 2 x 3 heads x 64 x 4 B


def tiny(**kw) -> LLM:
    # 7 usable blocks (112 tokens): four ~28-token prompts + 12 new tokens need 12.
    return LLM(kv_cache_memory_bytes=8 * BLOCK_BYTES, max_model_len=96,
               max_num_batched_tokens=128, quantization="none", **kw)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(SYSTEM + q).input_ids for q in QUESTIONS]


def _greedy(llm: LLM, prompts, n=NEW):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def test_greedy_identical_caching_on_off_swap_recompute_and_hits_reported(llm, prompts):
    llm.reset_prefix_cache()
    ref, first = _greedy(llm, prompts)
    again, second = _greedy(llm, prompts)  # same prompts again: served from the cache
    assert again == ref
    assert all(o.num_cached_tokens >= 16 for o in second)
    # A shared system prompt: later requests of one batch hit the first one's blocks.
    assert sum(o.num_cached_tokens for o in first[1:]) > 0

    off = tiny(enable_prefix_caching=False)
    assert _greedy(off, prompts)[0] == ref
    assert off.llm_engine.client.core.scheduler.total_preemptions > 0

    swap = tiny(preemption_mode="swap", swap_space=0.05)
    assert _greedy(swap, prompts)[0] == ref
    sched = swap.llm_engine.client.core.scheduler
    assert sched.swap.total_swaps > 0 and len(sched.swap.cpu_free) == sched.swap.num_cpu_blocks


def test_prompt_logprobs_requests_take_no_cache_hits(llm, prompts):
    _greedy(llm, prompts[:1], 2)
    out = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompts[0])


def test_n4_shares_the_prompt_and_equals_independent_seeded_requests(llm, prompts):
    p = {"prompt_token_ids": prompts[1]}
    llm.reset_prefix_cache()
    group = llm.generate([p], SamplingParams(n=4, temperature=0.8, seed=11, max_tokens=8),
                         use_tqdm=False)[0]
    llm.reset_prefix_cache()
    alone = llm.generate([p] * 4, [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=8)
                                   for i in range(4)], use_tqdm=False)
    assert [c.token_ids for c in group.outputs] == [o.outputs[0].token_ids for o in alone]
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5)])
def test_beam_search_equals_hugging_face(llm, hf_model, width, length_penalty):
    hf = hf_model
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "def fibonacci(n):"]
    ours = llm.beam_search(texts, BeamSearchParams(beam_width=width, max_tokens=10,
                                                   length_penalty=length_penalty))
    for text, out in zip(texts, ours):
        ids = tok(text).input_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                              num_beams=width, num_return_sequences=width,
                              length_penalty=length_penalty, top_p=None, top_k=None,
                              temperature=None)
        assert len(out.sequences) == width
        for seq, r in zip(out.sequences, ref.tolist()):
            gen = seq.tokens[len(ids):]
            pad = r[len(ids) + len(gen):]
            assert r[len(ids):len(ids) + len(gen)] == gen
            assert all(t in (tok.eos_token_id, tok.pad_token_id) for t in pad)
