"""The per-step speculation policy in a real engine (default SmolLM2, CPU): whatever it
decides -- full k, fewer drafts as the batch grows, none, probes -- batched greedy output
is token for token decoding without speculation; and the measured curve is there."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.policy import SpecPolicy, StepCostCurve
from pagedllm.worker.cuda_graphs import GraphShape
from pagedllm.worker.step_cost import curve_from_graphs, eager_ladder

TEXT = ("The library opens at nine in the morning and closes at six in the evening. "
        "Visitors may borrow up to five books at a time for three weeks.")
PROMPTS = [f"Text: {TEXT}\nRepeat the text above exactly:",
           f"Note: {TEXT}\nCopy the note above word for word:",
           "Write a short poem about the sea and the wind.",
           "List three colours and one animal for each.",
           f"{TEXT}\nSummarise this in one sentence:",
           "What is the capital of France? Answer briefly."]
K = 4
# Free up to 12 tokens, then steep: 6 requests may verify 1 draft each (12 tokens) but
# not more; as requests finish, k' grows.
STEEP = StepCostCurve((), ((1, 1.0), (12, 1.0), (16, 3.0), (64, 12.0)), False,
                      "synthetic steep")


def test_curve_from_graph_capture_timings_and_eager_ladder():
    class Graphs:  # what curve_from_graphs reads of a CudaGraphRunner
        replay_ms = {GraphShape(8, 8, True): 2.0, GraphShape(1, 1, True): 1.0,
                     GraphShape(8, 16, False): 3.0, GraphShape(8, 8, False): 2.5}

    c = curve_from_graphs(Graphs())
    assert c is not None and c.padded
    assert c.decode == ((1, 1.0), (8, 2.0)) and c.mixed == ((8, 2.5), (16, 3.0))
    assert c.decode_ms(5) == 2.0 and c.mixed_ms(9) == 3.0
    Graphs.replay_ms = {GraphShape(1, 1, True): 1.0}
    assert curve_from_graphs(Graphs()) is None  # no chunk graphs: verify runs eagerly
    assert eager_ladder(20) == [1, 2, 4, 8, 16, 20] and eager_ladder(1) == [1]
    assert eager_ladder(10**6)[-1] == 2048


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(kv_cache_memory_bytes=32 << 20, max_model_len=256,
               max_num_batched_tokens=256, quantization="none",
               speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                   "prompt_lookup_max": 3})


def _run(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def want(llm):
    return _run(llm)


def test_measured_curve_and_no_cap_by_default(spec_llm):
    spec = spec_llm.llm_engine.client.core.scheduler.spec
    curve = spec.policy.curve
    assert curve is not None and curve.source.startswith("eager forwards")
    sizes, ms = zip(*curve.mixed)
    assert sizes[0] == 1 and all(b == 2 * a for a, b in zip(sizes[:-1], sizes[1:-1]))
    assert all(0 < a <= b for a, b in zip(ms, ms[1:]))  # non-decreasing
    assert spec.policy.max_batch is None  # disable_by_batch_size: no cap by default


@pytest.mark.parametrize("curve", ["steep", "linear"])  # the measured one: test_spec_greedy
def test_greedy_identical_whatever_the_policy_decides(want, spec_llm, curve):
    spec = spec_llm.llm_engine.client.core.scheduler.spec
    measured = spec.policy.curve
    if curve == "steep":
        spec.policy = SpecPolicy(K, STEEP)
    elif curve == "linear":  # compute-bound: no drafts after the optimistic start
        spec.policy = SpecPolicy(K, StepCostCurve(
            (), ((1, 1.0), (1024, 1024.0)), False, "synthetic linear"))
    before = (spec.total_steps, spec.total_spec_steps, spec.total_draft_tokens,
              spec.total_drafts)
    try:
        got = _run(spec_llm)
    finally:
        spec.policy = SpecPolicy(K, measured)
    assert got == want
    steps, spec_steps, draft_tokens, drafts = (
        a - b for a, b in zip((spec.total_steps, spec.total_spec_steps,
                               spec.total_draft_tokens, spec.total_drafts), before))
    if curve == "linear":
        assert spec_steps == 0
    if curve == "steep":  # speculated, but not always at full k, and not every step
        assert 0 < spec_steps < steps
        assert draft_tokens < K * drafts


@pytest.fixture(scope="module")
def async_spec_llm():
    return LLM(kv_cache_memory_bytes=32 << 20, max_model_len=256,
               max_num_batched_tokens=256, quantization="none", async_scheduling=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                   "prompt_lookup_max": 3})


@pytest.mark.parametrize("curve", ["steep", "linear"])
def test_ngram_keeps_async_scheduling_while_the_policy_is_off(want, async_spec_llm, curve):
    """n-gram speculation pauses async scheduling only while proposals are wanted: with a
    compute-bound curve (no drafts after the optimistic start) most steps run async; with
    a steep one some steps speculate, and the output is the same either way."""
    core = async_spec_llm.llm_engine.client.core
    assert core.async_scheduling
    spec = core.scheduler.spec
    measured = spec.policy.curve
    spec.policy = SpecPolicy(K, STEEP if curve == "steep" else StepCostCurve(
        (), ((1, 1.0), (1024, 1024.0)), False, "synthetic linear"))
    seen: list[bool] = []
    real = core.scheduler.requires_sync

    def spy() -> bool:
        seen.append(real())
        return seen[-1]

    core.scheduler.requires_sync = spy
    before = spec.total_spec_steps
    try:
        got = _run(async_spec_llm)
    finally:
        core.scheduler.requires_sync = real
        spec.policy = SpecPolicy(K, measured)
    assert got == want
    if curve == "linear":
        assert spec.total_spec_steps == before
        assert seen.count(False) > len(seen) // 2  # mostly async
    else:
        assert spec.total_spec_steps > before and True in seen


def test_async_scheduling_refused_with_a_draft_model():
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="x", async_scheduling=True,
                   speculative_config={"method": "draft_model", "model": "y",
                                       "num_speculative_tokens": 2}).create_engine_config()
