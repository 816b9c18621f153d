"""FP8 accuracy on the real SmolLM2-135M-Instruct GGUF (CPU, fp32 compute): perplexity
over Newton's *Opticks* (``pagedllm bench perplexity``'s text) and greedy agreement with
the unquantised engine, for ``quantization="fp8"`` (W8A8) and ``kv_cache_dtype="fp8"``.

Thresholds (a small sample: 1,024 scored tokens, 8 prompts x 16 greedy tokens; the larger
CPU run in docs/benchmarks.md measured +3.4% and +1.7% perplexity, 25% and 44% of 16
prompts identical, mean |Δ logprob| 0.13 and 0.06): W8A8 perplexity within 6%, fp8 KV
within 3%; at least 1 in 8 (W8A8) and 2 in 8 (KV) prompts identical for 16 tokens; mean
|Δ logprob| of the unquantised engine's greedy tokens below 0.25 and 0.12.
"""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.perplexity import run
from pagedllm.config import EngineArgs


@pytest.fixture(scope="module")
def results() -> dict:
    # The float32 dequantised GGUF is the unquantised reference (not the int4 default).
    base = EngineArgs(device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                      quantization="none")
    res = run(base, [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}], num_tokens=1024,
              window=512, num_prompts=8, prompt_len=32, gen_len=16)
    return {v["variant"]: v for v in res["variants"]} | {"baseline": res["baseline"]}


def test_fp8_weights_accuracy(results: dict) -> None:
    r = results["quantization=fp8"]
    assert abs(r["perplexity_change_pct"]) < 6.0
    assert r["identical_share"] >= 1 / 8
    assert r["mean_abs_delta_logprob"] < 0.25


def test_fp8_kv_cache_accuracy(results: dict) -> None:
    r = results["kv_cache_dtype=fp8"]
    assert abs(r["perplexity_change_pct"]) < 3.0
    assert r["identical_share"] >= 2 / 8
    assert r["mean_abs_delta_logprob"] < 0.12
