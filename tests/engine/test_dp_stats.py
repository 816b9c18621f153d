"""The DP client's totals over engines (``DPClient._total``): gauges summed or weighted
by each engine's pool, per-step counters taken from the reporting engine, for the KV
pool and both offload tiers (host and disk)."""

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
                          kv_offload_queries=9, kv_offload_hits=4)
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
