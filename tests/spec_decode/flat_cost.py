"""Tests of lossless verification pin a flat step cost and switch the policy's time
calibration off: drafts are then verified whatever a shared, noisy CPU measured at
start-up or while running (spec_decode/policy.py; the policy's own tests are
test_spec_policy*.py)."""

from __future__ import annotations

from typing import Any

from pagedllm.spec_decode.policy import SpecPolicy, StepCostCurve

FLAT = StepCostCurve((), ((1, 1.0), (1 << 20, 1.0)), False, "flat (test)")


def pin_flat_step_cost(llm: Any, k: int, max_batch: int | None = None) -> None:
    """Give ``llm``'s speculation policy a flat step-cost curve, uncalibrated (step
    times are not fed to it: acceptance alone decides); ``max_batch``: the config's
    ``disable_by_batch_size``."""
    policy = SpecPolicy(k, FLAT, max_batch)
    policy.observe_time = lambda *args, **kwargs: None  # type: ignore[method-assign]
    llm.llm_engine.client.core.scheduler.spec.policy = policy
