"""Greedy decoding on the GPU (bf16, Triton kernels, CUDA graphs, async scheduling)
against the CPU fp32 reference on the real default model (SmolLM2-135M-Instruct GGUF).

bf16 rounds differently from fp32, so a near-tie between the two best tokens may flip
and the continuations diverge from there.  The check is vLLM's ``check_logprobs_close``:
where the two first differ, each one's token must be among the other's top 5, and while
they agree the chosen tokens' logprobs must stay close.  It also reports how many of
the prompts agree on all 32 tokens.
Run on a GPU machine: ``pytest tests/e2e/test_gpu_parity.py -m gpu``.
"""

from __future__ import annotations

import gc
import statistics

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.e2e.greedy_compare import compare_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 32
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Give me a short tip for learning to cook.",
    "What does a CPU do?",
]
RAW = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
       "1, 2, 3, 4, 5,"]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        assert c.logprobs is not None
        out.append((list(c.token_ids), [{t: lp.logprob for t, lp in step.items()}
                                        for step in c.logprobs]))
    return out


@pytest.fixture(scope="module")
def cpu_reference(default_model_path: str) -> tuple[list[list[int]], list]:
    cpu = LLM(default_model_path, device="cpu", dtype="float32", quantization="none",
              max_model_len=512,
              kv_cache_memory_bytes=256 << 20)
    prompts = [cpu.llm_engine.input_processor.apply_chat_template(
        [{"role": "user", "content": c}]) for c in CHAT]
    prompts += [cpu.get_tokenizer()(r).input_ids for r in RAW]
    return prompts, _run(cpu, prompts)


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
def test_gpu_bf16_greedy_matches_cpu_fp32(default_model_path: str, cpu_reference: tuple,
                                          alone: bool) -> None:
    """``alone``: each prompt in its own generate call, so its prompt replays a
    prompt-chunk CUDA graph and every decode step is batch 1 and runs the batch-1 GEMV
    kernels (``kernels/gemv.py``) instead of cuBLAS."""
    prompts, ref = cpu_reference
    gpu = LLM(default_model_path, device="cuda", dtype="bfloat16", quantization="none",
              max_model_len=512,
              gpu_memory_utilization=0.3)
    try:
        got = [r for p in prompts for r in _run(gpu, [p])] if alone else _run(gpu, prompts)
    finally:
        del gpu  # free the KV cache before the next case builds its engine
        gc.collect()
        torch.cuda.empty_cache()

    identical, diffs, flips = compare_greedy(got, ref)
    report = (f"{identical}/{len(prompts)} identical for {NEW_TOKENS} tokens; first "
              f"differences (prompt, index, gpu token in cpu top-5, cpu in gpu top-5): "
              f"{flips}; largest logprob diffs {sorted(diffs)[-5:]}")
    print(report)
    assert all(a and b for _, _, a, b in flips), report
    assert statistics.median(diffs) < 0.05 and max(diffs) < 0.5, report


def test_gpu_gguf_quantised_greedy_close_to_cpu_fp32(default_model_path: str,
                                                     cpu_reference: tuple) -> None:
    """The default on the GPU: the GGUF kept quantised (int4 tinygemm kernels, a dense
    bf16 embedding table, the packed tied lm_head).  Where greedy paths part, each
    token must be in the other's top 5."""
    prompts, ref = cpu_reference
    gpu = LLM(default_model_path, device="cuda", dtype="bfloat16", max_model_len=512,
              gpu_memory_utilization=0.3)
    try:
        assert gpu.llm_engine.config.model_config.quantization == "gguf"
        got = _run(gpu, prompts)
    finally:
        del gpu
        gc.collect()
        torch.cuda.empty_cache()
    identical, diffs, flips = compare_greedy(got, ref)
    report = (f"{identical}/{len(prompts)} identical for {NEW_TOKENS} tokens; first "
              f"differences: {flips}; largest logprob diffs {sorted(diffs)[-5:]}")
    print(report)
    assert all(a and b for _, _, a, b in flips), report
