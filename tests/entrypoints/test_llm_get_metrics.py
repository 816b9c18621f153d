"""``LLM.get_metrics()`` (issue 46 item 16): vLLM's offline metrics API, read from the
engine's own Prometheus registry -- counters, gauges, histograms, prefix-cache hits and,
with speculative decoding, drafts, acceptance and the per-position ``Vector``."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.messages import SchedulerStats
from pagedllm.metrics import EngineMetrics
from pagedllm.metrics_reader import Counter, Gauge, Histogram, Vector, snapshot
from tests.spec_decode.flat_cost import pin_flat_step_cost

# Input-grounded (the model copies it), so the n-gram proposer's drafts get verified.
PROMPT = ("Text: The library opens at nine in the morning and closes at six in the "
          "evening. Visitors may borrow up to five books at a time.\n"
          "Repeat the text above exactly:")


def _one(metrics: list[Any], name: str, kind: type) -> Any:
    found = [m for m in metrics if m.name == name and isinstance(m, kind)]
    assert len(found) == 1, (name, found)
    return found[0]


def test_reader_shapes_match_vllm() -> None:
    m = EngineMetrics("m", process_collectors=False)
    m.record_stats(SchedulerStats(num_running_reqs=2, prefix_cache_queries=32,
                                  prefix_cache_hits=16, num_scheduled_tokens=40,
                                  spec_num_drafts=2, spec_num_draft_tokens=6,
                                  spec_num_accepted_tokens=4, spec_accepted_per_pos=[2, 1, 1]))
    got = snapshot(m.registry)
    assert all(g.name.startswith(("vllm:", "pagedllm:")) for g in got)
    hits = _one(got, "vllm:prefix_cache_hits", Counter)
    assert hits.value == 16 and hits.labels == {"model_name": "m", "engine": "0"}
    assert _one(got, "vllm:num_requests_running", Gauge).value == 2.0
    it = _one(got, "vllm:iteration_tokens_total", Histogram)
    assert (it.count, it.sum) == (1, 40.0) and it.buckets["+Inf"] == 1
    assert it.buckets["32.0"] == 0 and it.buckets["64.0"] == 1  # cumulative, by "le"
    assert _one(got, "vllm:spec_decode_num_accepted_tokens_per_pos", Vector).values == [2, 1, 1]
    assert not any(g.name.endswith(("_total_total", "_created")) for g in got)


def test_without_speculation_there_are_no_spec_decode_series() -> None:
    m = EngineMetrics("m", process_collectors=False, speculative=False)
    m.record_stats(SchedulerStats(spec_num_drafts=1, spec_num_draft_tokens=1))
    assert not [g for g in snapshot(m.registry) if "spec_decode" in g.name]


@pytest.fixture(scope="module")
def spec_llm() -> Any:
    llm = LLM(max_model_len=128, kv_cache_memory_bytes=16 << 20, quantization="none",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3})
    pin_flat_step_cost(llm, 3)  # drafts whatever this machine's step costs are
    yield llm
    llm.shutdown()


def test_llm_get_metrics_counts_what_ran(spec_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = spec_llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    got = spec_llm.get_metrics()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert _one(got, "vllm:generation_tokens", Counter).value == gen
    assert _one(got, "vllm:prompt_tokens", Counter).value == prompt
    done = {c.labels["finished_reason"]: c.value for c in got
            if c.name == "vllm:request_success"}
    assert done["length"] == 2
    assert _one(got, "vllm:e2e_request_latency_seconds", Histogram).count == 2
    # The second prompt repeats the first: its full blocks come from the prefix cache.
    assert _one(got, "vllm:prefix_cache_queries", Counter).value >= prompt
    assert _one(got, "vllm:prefix_cache_hits", Counter).value > 0
    # A repetitive prompt gives the n-gram proposer drafts to verify.
    drafts = _one(got, "vllm:spec_decode_num_draft_tokens", Counter).value
    accepted = _one(got, "vllm:spec_decode_num_accepted_tokens", Counter).value
    vectors = [m for m in got if isinstance(m, Vector)]
    assert drafts > 0 and 0 <= accepted <= drafts, (drafts, accepted)
    # (positions appear once a draft there was accepted)
    assert sum(v for m in vectors for v in m.values) == accepted, vectors
    assert all(m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" for m in vectors)
