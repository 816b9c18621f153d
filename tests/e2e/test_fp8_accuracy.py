"""FP8 accuracy on the real SmolLM2-135M-Instruct GGUF (CPU, fp32 compute): perplexity
over Newton's *Opticks* (``pagedllm bench perplexity``'s text) and greedy agreement with
the unquantised engine, for ``quantization="fp8"`` (W8A8), ``kv_cache_dtype="fp8"`` with
the default scales of 1.0, and with ``calculate_kv_scales`` (first-batch scales).

Thresholds (a small sample: 1,024 scored tokens, 8 prompts x 16 greedy tokens).  The
issue's bounds are 3% (W8A8) and 1% (fp8 KV), judged on the larger samples in
docs/benchmarks.md (8,192 tokens, two texts): W8A8 meets its bound there (+2.72% and
+2.12%, with the per-tensor weight scales of online quantisation), fp8 KV does not (+1.32%
at scale 1.0, +1.63% with calculated scales).  Why fp8 KV cannot meet 1% on this model
(``benchmarks/fp8_kv_probe.py``): its cost is e4m3's 3-bit mantissa on the keys (keys
alone +1.30%, values alone +0.12%; 3 mantissa bits with no subnormals and no saturation
+1.35%), so no per-tensor scale can remove it.  On this small sample the figures move by
a point or more under changes at the level of last bits (W8A8 with per-channel weight
scales: +5.24% with torch's ``silu``, +5.88% with ``g * sigmoid(g)``, +6.28% with
``cpu/silu_mul.py``'s, because the per-token e4m3 activations round differently; fp8 KV
with calculated scales +0.02% here against +1.63% on 8,192 tokens), so each variant
asserts its measured figure with margin, to catch a broken scale or rounding path:
W8A8 within 5% (this sample: +2.82%), fp8 KV within 4% with either scale (+2.5% at
1.0).  Greedy agreement: at least 1 in 8 (W8A8, calculated KV scales; W8A8 measured 1 /
8) and 2 in 8 (KV at 1.0) prompts identical for 16 tokens (measured 4 / 8 and 1 / 8 for
the KV variants); mean |Δ logprob| of the unquantised engine's greedy tokens below 0.25,
0.16 and 0.12 (measured 0.152, 0.119 and 0.079).
"""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.perplexity import run
from pagedllm.engine.arg_utils import EngineArgs


@pytest.fixture(scope="module")
def results() -> dict:
    # The float32 dequantised GGUF is the unquantised reference (not the int4 default).
    base = EngineArgs(device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                      quantization="none")
    res = run(base, [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                     {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}],
              num_tokens=1024, window=512, num_prompts=8, prompt_len=32, gen_len=16)
    return {v["variant"]: v for v in res["variants"]} | {"baseline": res["baseline"]}


def test_fp8_weights_accuracy(results: dict) -> None:
    r = results["quantization=fp8"]
    assert abs(r["perplexity_change_pct"]) < 5.0
    assert r["identical_share"] >= 1 / 8
    assert r["mean_abs_delta_logprob"] < 0.25


def test_fp8_kv_cache_accuracy(results: dict) -> None:
    r = results["kv_cache_dtype=fp8"]
    assert abs(r["perplexity_change_pct"]) < 4.0
    assert r["identical_share"] >= 2 / 8
    assert r["mean_abs_delta_logprob"] < 0.16


def test_fp8_kv_cache_calculated_scales_accuracy(results: dict) -> None:
    r = results["kv_cache_dtype=fp8,calculate_kv_scales=True"]
    assert abs(r["perplexity_change_pct"]) < 4.0
    assert r["identical_share"] >= 1 / 8
    assert r["mean_abs_delta_logprob"] < 0.12
