"""The DP client: its totals over engines (``DPClient._total``: gauges summed or
weighted by each engine's pool, per-step counters taken from the reporting engine, for
the KV pool and both offload tiers), and each engine's rank, devices and ports."""

from __future__ import annotations

import pytest

from pagedllm.engine.dp_client import DPClient
from pagedllm.messages import SchedulerStats


def test_totals_over_engines_include_both_offload_tiers() -> None:
    client = DPClient.__new__(DPClient)  # no engines started: only the arithmetic
    client.engine_stats = [
        SchedulerStats(num_running_reqs=2, num_free_blocks=10, num_total_blocks=40,
                       kv_offload_usage=0.5, kv_offload_total_blocks=100,
                       kv_offload_disk_usage=0.25, kv_offload_disk_total_blocks=400),
        SchedulerStats(num_running_reqs=1, num_free_blocks=30, num_total_blocks=40,
                       kv_offload_usage=1.0, kv_offload_total_blocks=300,
                       kv_offload_disk_usage=1.0, kv_offload_disk_total_blocks=200)]
    step = SchedulerStats(kv_offload_disk_queries=7, kv_offload_disk_hits=3,
                          kv_offload_bytes_to_disk=4096, kv_offload_bytes_from_disk=2048,
                          kv_offload_queries=9, kv_offload_hits=4,
                          num_scheduled_tokens=33, num_preemptions=1,
                          spec_num_drafts=5, spec_num_draft_tokens=15,
                          spec_num_accepted_tokens=11, spec_accepted_per_pos=[5, 4, 2])
    t = client._total(step)
    assert (t.num_running_reqs, t.num_free_blocks, t.num_total_blocks) == (3, 40, 80)
    assert t.kv_cache_usage == pytest.approx(0.5)
    assert t.kv_offload_total_blocks == 400
    assert t.kv_offload_usage == pytest.approx((50 + 300) / 400)
    assert t.kv_offload_disk_total_blocks == 600
    assert t.kv_offload_disk_usage == pytest.approx((100 + 200) / 600)
    assert (t.kv_offload_disk_queries, t.kv_offload_disk_hits) == (7, 3)
    assert (t.kv_offload_bytes_to_disk, t.kv_offload_bytes_from_disk) == (4096, 2048)
    assert (t.kv_offload_queries, t.kv_offload_hits) == (9, 4)
    # The step's own counters pass through (they were dropped to 0 before).
    assert (t.num_scheduled_tokens, t.num_preemptions) == (33, 1)
    assert (t.spec_num_drafts, t.spec_num_draft_tokens, t.spec_num_accepted_tokens,
            t.spec_accepted_per_pos) == (5, 15, 11, [5, 4, 2])


def test_each_engine_gets_its_rank_and_its_own_devices() -> None:
    """Data-parallel engines on one host: engine d's ranks take the devices after
    engines 0..d-1's (each engine was on device 0 before); only expert parallelism
    across engines adds the shared ports."""
    from pagedllm.config import ParallelConfig
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.dp_client import engine_configs
    from pagedllm.worker.worker import device_index

    plain = engine_configs(EngineArgs(data_parallel_size=2, tensor_parallel_size=2), 2)
    assert [a.data_parallel_rank for a in plain] == [0, 1]
    assert {a.data_parallel_master_port for a in plain} == {0}
    ep = engine_configs(EngineArgs(data_parallel_size=2, enable_expert_parallel=True), 2)
    assert [a.data_parallel_rank for a in ep] == [0, 1]
    assert ep[0].data_parallel_master_port > 0 and ep[0].data_parallel_rpc_port > 0
    assert ep[0].data_parallel_master_port == ep[1].data_parallel_master_port
    pcs = [ParallelConfig(tensor_parallel_size=2, data_parallel_size=3,
                          data_parallel_rank=d) for d in range(3)]
    assert [device_index(pc, r) for pc in pcs for r in range(2)] == [0, 1, 2, 3, 4, 5]
    assert device_index(ParallelConfig(tensor_parallel_size=2), 1) == 1


def test_expert_parallel_ports_are_distinct(monkeypatch) -> None:
    """The ranks' rendezvous and the cores' lockstep both bind a port on engine 0: the
    same free port handed out twice must not become both."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.dp_client import engine_configs
    from pagedllm.executor import process_start

    ports = iter([41000, 41000, 41000, 41001])
    monkeypatch.setattr(process_start, "free_port", lambda host="127.0.0.1": next(ports))
    ep = engine_configs(EngineArgs(data_parallel_size=2, enable_expert_parallel=True), 2)
    assert {(a.data_parallel_master_port, a.data_parallel_rpc_port) for a in ep} == \
        {(41000, 41001)}


def test_a_lockstep_that_cannot_be_joined_is_a_start_up_error(monkeypatch) -> None:
    """The lockstep is joined after the core is built, outside the start-up ``try``;
    a failure there must come back as a reason (it used to vanish in ``os._exit``)."""
    from types import SimpleNamespace

    from pagedllm.engine import core_proc, dp_lockstep

    def refuse(self, parallel) -> None:
        raise RuntimeError("The server socket has failed to listen on any local network "
                           "address.\nport 41000 in use")

    monkeypatch.setattr(dp_lockstep.DPLockstep, "__init__", refuse)
    proc = SimpleNamespace(lockstep=None)
    core = SimpleNamespace(lockstep=True, config=SimpleNamespace(parallel_config=None))
    error = core_proc._join_lockstep(proc, core)  # type: ignore[arg-type]
    assert error is not None and "step lockstep failed" in error \
        and "failed to listen" in error and "\n" not in error
    assert proc.lockstep is None
    assert core_proc._join_lockstep(proc, SimpleNamespace(lockstep=False)) is None
