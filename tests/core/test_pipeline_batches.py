"""The scheduler under pipeline parallelism's batch queue (``EngineCore._step_pipelined``
drives it the same way): with ``in_flight_req_ids`` / ``max_num_scheduled_reqs`` passed
to each ``schedule``, batches in flight never share a request, each takes at most
its share of the live requests, and the outputs -- with preemption, including of
requests whose batch is in flight -- equal running one batch at a time.  The fake runner
executes a batch when it is launched, as the first stage does."""

from __future__ import annotations

from collections import deque

import pytest

from pagedllm.core.scheduler import Scheduler
from tests.core.fake_runner import FakeRunner
from tests.core.test_scheduler import assert_all_free, make_scheduler, req, run_to_completion


def _add(s: Scheduler) -> Scheduler:
    for i in range(6):
        s.add_request(req(f"r{i}", 5 + 3 * i, 12 + i, first=10 * i + 1))
    return s


def run_pipelined(s: Scheduler, runner: FakeRunner, depth: int) -> tuple[dict, int]:
    """Outputs per request and the most batches that were in flight at once."""
    outputs: dict[str, list[int]] = {}
    queue: deque = deque()
    deepest = 0
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            for so, out in queue:  # what is left serves only finished requests
                s.update_from_output(so, out)
            return outputs, deepest
        if len(queue) < depth:
            in_flight = set().union(*(so.num_scheduled_tokens for so, _ in queue))
            max_reqs = -(-len(s.requests) // depth) or 1
            so = s.schedule(in_flight_req_ids=in_flight, max_num_scheduled_reqs=max_reqs)
            assert not set(so.num_scheduled_tokens) & in_flight
            assert len(so.num_scheduled_tokens) <= max_reqs
            queue.append((so, runner.execute_model(so)))
            deepest = max(deepest, len(queue))
            if len(queue) < depth:
                continue
        so, out = queue.popleft()
        for o in s.update_from_output(so, out).outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("depth", [2, 3])
def test_batches_in_flight_are_disjoint_and_outputs_equal_sequential(depth: int) -> None:
    reference, _ = run_to_completion(_add(make_scheduler(num_blocks=200)), FakeRunner())
    s = _add(make_scheduler(num_blocks=16))  # 15 usable blocks of 4: preemption
    runner = FakeRunner()
    outs, deepest = run_pipelined(s, runner, depth)
    assert deepest == depth
    assert s.total_preemptions > 0
    assert outs == reference
    assert_all_free(s)
