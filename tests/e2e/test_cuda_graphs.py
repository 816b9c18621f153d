"""CUDA-graph replay against eager on the GPU (dummy SmolLM2-shaped bf16 model).

Alone, each prompt is a lone prompt chunk (a chunk graph when it has <= 2048 tokens,
eager above) and its decode steps are batch 1 (a decode graph).  Batched with a
512-token step budget, long prompts are split into chunks that share steps with other
requests' decodes and chunks: mixed steps, replayed from chunk graphs.  The same engine
settings with ``enforce_eager=True`` give the reference.

A replay pads the step to a captured shape, and cuBLAS may pick another kernel for the
padded row count, so bf16 results can differ in the last bit: a near-tie between the two
best tokens may then flip.  Like the GPU-vs-CPU parity test, this checks that wherever
the two runs first differ, each one's token is in the other's top 5, and that while they
agree the chosen tokens' logprobs stay within 0.1; most prompts must agree throughout.
Run on a GPU machine: ``pytest tests/e2e/test_cuda_graphs.py -m gpu``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import write_dummy_model
from tests.e2e.greedy_compare import compare_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Prompt lengths around the captured prompt sizes (8 ... 2048) and past the largest.
LENGTHS = [2, 7, 8, 9, 63, 100, 255, 257, 512, 600, 1024, 1300, 2048, 2300]


def _run(graphs: bool, prompts: list[list[int]], alone: bool,
         max_capture: int = 2048) -> list[tuple[list[int], list[dict]]]:
    # "normal" dummy weights: logits far enough apart for bf16 tokens to compare.
    llm = LLM(write_dummy_model("smollm2-135m"), load_format="dummy",
              model_loader_extra_config={"dummy_init": "normal"}, skip_tokenizer_init=True,
              max_model_len=4096, kv_cache_memory_bytes=1 << 30,
              enforce_eager=not graphs, seed=0, max_cudagraph_capture_size=max_capture,
              max_num_batched_tokens=None if alone else 512)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = []
    try:
        outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)] \
            if alone else llm.generate(prompts, params, use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.logprobs is not None
            out.append((list(c.token_ids),
                        [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs]))
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "batched"])
def test_chunk_and_decode_graphs_match_eager(alone: bool) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 49000) for _ in range(n)] for n in LENGTHS]
    eager, graphed = _run(False, prompts, alone), _run(True, prompts, alone)
    identical, diffs, flips = compare_greedy(graphed, eager)
    report = f"{identical}/{len(LENGTHS)} identical; first differences {flips}"
    assert max(diffs) < 0.1, report
    assert all(a and b for _, _, a, b in flips), report
    assert identical >= len(LENGTHS) - 2, report


def test_large_chunk_graphs_match_eager() -> None:
    """--max-cudagraph-capture-size 4096: prompts of 2,300-4,000 tokens replay chunk graphs
    of 2,560-4,096 tokens (eager at the default) and agree with eager."""
    rng = random.Random(1)
    lengths = [2049, 2300, 3000, 3584, 4000]
    prompts = [[rng.randrange(1000, 49000) for _ in range(n)] for n in lengths]
    eager = _run(False, prompts, True)
    graphed = _run(True, prompts, True, max_capture=4096)
    identical, diffs, flips = compare_greedy(graphed, eager)
    report = f"{identical}/{len(lengths)} identical; first differences {flips}"
    assert max(diffs) < 0.1, report
    assert all(a and b for _, _, a, b in flips), report
    assert identical >= len(lengths) - 1, report
