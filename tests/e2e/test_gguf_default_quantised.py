"""The default model runs its GGUF kept quantised by default: weight memory against the
file's size, and greedy agreement with the float32 dequantised path (the session
``llm`` fixture, quantization "none", which equals HF token for token).

Threshold: the quantised path computes its matmuls from bf16 activations (and bf16
scales), so greedy paths part where two logits are within that rounding; we require the
first greedy token to agree for at least 6 of the 8 prompts and, summed over the
prompts, at least half of the 24-token greedy paths to agree before they part
(measured figures in docs/findings.md, "CPU: the GGUF kept quantised").
"""

from __future__ import annotations

import os

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import weight_bytes

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a",
           "The three primary colours are", "To make a cup of tea, first",
           "Water boils at a temperature of", "The largest planet in our solar system",
           "import numpy as np\n"]
NEW = 24


@pytest.fixture(scope="module")
def quantised(default_model_path: str) -> LLM:
    return LLM(kv_cache_memory_bytes=64 << 20, max_model_len=256,
               max_num_batched_tokens=256)


def _greedy(engine: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, sp, use_tqdm=False)]


def test_default_is_quantised_and_compact(quantised: LLM, default_model_path: str) -> None:
    mc = quantised.llm_engine.config.model_config
    assert mc.quantization == "gguf"
    size = os.path.getsize(mc.resolved.gguf_path)
    model = quantised.llm_engine.client.core.executor.worker.model
    assert weight_bytes(model) <= 1.3 * size


def test_greedy_agrees_with_the_fp32_path(quantised: LLM, llm: LLM) -> None:
    got, want = _greedy(quantised), _greedy(llm)
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), NEW)
              for g, w in zip(got, want)]
    first = sum(n > 0 for n in prefix)
    assert first >= 6 and sum(prefix) >= 0.5 * NEW * len(PROMPTS), (prefix, got, want)
