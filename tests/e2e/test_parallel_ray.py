"""The Ray executor on a local Ray cluster the test starts and stops: greedy tokens of
TP=2 and PP=2 equal TP=1 on the default model (fp32, gloo), batched and preempted;
a killed rank actor is reported naming the rank."""

from __future__ import annotations

import pytest

from pagedllm.executor.base import ExecutorError
from tests.e2e.test_parallel import PROMPTS, _engine, _greedy, reference  # noqa: F401

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    # Two CPUs: one bundle per rank.  Workers inherit this environment (PYTHONPATH).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_ray_greedy_equals_tp1(ray_cluster, reference, tp: int, pp: int) -> None:  # noqa: F811
    llm = _engine(tp, pp)  # inside a Ray session the backend defaults to "ray"
    try:
        core = llm.llm_engine.client.core
        assert core.config.parallel_config.distributed_executor_backend == "ray"
        assert _greedy(llm) == reference
        assert core.scheduler.total_preemptions > 0
        assert core.max_batches_in_flight == (pp if pp > 1 else 0)
        if pp == 2:  # last: a rank actor killed mid-service is reported by rank
            ray.kill(core.executor.actors[1])
            with pytest.raises(ExecutorError, match="rank 1 died"):
                _greedy(llm)
    finally:
        llm.llm_engine.shutdown()
    # The placement group (and with it every rank's reservation) is gone.
    table = ray.util.placement_group_table()
    assert table and all(pg["state"] == "REMOVED" for pg in table.values())
