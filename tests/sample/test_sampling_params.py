"""SamplingParams validation details the sampler relies on."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


def test_greedy_normalises_truncation_knobs() -> None:
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=1)
    assert (p.top_k, p.top_p, p.min_p) == (-1, 1.0, 0.0)
    assert p.sampling_type == SamplingType.GREEDY


def test_top_k_zero_means_disabled() -> None:
    assert SamplingParams(top_k=0).top_k == -1
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_logit_bias_keys_and_values() -> None:
    assert SamplingParams(logit_bias={"5": 3, 7: -200}).logit_bias == {5: 3.0, 7: -100.0}
    for bad in ({"x": 1}, {1.5: 1}, {True: 1}, {1: "a"}, {1: float("nan")}, {"-3": 1}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


def test_clone_revalidates() -> None:
    p = SamplingParams(stop="x", logit_bias={1: 2.0})
    q = p.clone(temperature=0.5)
    assert q.stop == ["x"] and q.logit_bias == {1: 2.0} and q.temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0.0)
