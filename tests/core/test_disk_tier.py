"""The prefix cache's disk tier (core/disk_tier.py) behind the host tier, on the
scheduler with a fake runner (which simulates the disk file too): blocks the host evicts
go to disk and come back through a host slot on a hit, holding their tokens; outputs
equal prefix caching off; hits counted; LRU order; and -- the host tier's Hypothesis
state machine on a 3-slot host pool with an 8-slot disk pool -- nothing leaked, doubled
or corrupted in any pool, also when a request waiting for a disk load is aborted."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.disk_tier import DiskTier
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.offload_tier import OffloadTier
from pagedllm.core.scheduler import Scheduler
from tests.core.fake_runner import FakeRunner
from tests.core.test_offload_tier import (
    BS,
    TierMachine,
    assert_nothing_held,
    conversation,
    multiturn,
    req,
    run,
)


def make(num_blocks=24, host_blocks=4, disk_blocks=64, caching=True, budget=32,
         mode="recompute", cpu_blocks=0, max_seqs=8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                        max_model_len=256, preemption_mode=mode),
        CacheConfig(block_size=BS, enable_prefix_caching=caching,
                    num_offload_blocks=host_blocks, kv_offload_block_bytes=100,
                    num_offload_disk_blocks=disk_blocks),
        num_blocks, cpu_blocks)


def disk_of(s: Scheduler) -> DiskTier:
    assert s.offload is not None and s.offload.disk is not None
    return s.offload.disk


def test_three_tiers_equal_caching_off_and_hit_where_two_miss() -> None:
    """A 23-block device pool holds one conversation's history at a time and a 4-slot
    host pool almost nothing: later turns find their history on disk (the fake runner
    re-reads every position, so a block that came back wrong fails the run)."""
    ref, _ = multiturn(make(caching=False, disk_blocks=0), FakeRunner(BS))
    _, two_cached = multiturn(make(disk_blocks=0), FakeRunner(BS))
    s = make()
    runner = FakeRunner(BS, pool=s.kv.pool)
    got, cached = multiturn(s, runner)
    assert got == ref
    for c in range(4):
        for t in range(1, 3):
            assert cached[f"c{c}t{t}"] >= (len(conversation(c, t - 1)) // BS) * BS
    assert sum(cached.values()) > sum(two_cached.values())
    assert any(so.kv_disk_save for so in runner.steps)
    assert any(so.kv_disk_load for so in runner.steps)
    # A disk load always goes with the host load that reads its slot, the same step.
    for so in runner.steps:
        assert {h for _, h in so.kv_disk_load} <= {h for h, _ in so.kv_load}
    assert runner.disk and 0 < s.make_stats().kv_offload_disk_usage <= 1
    assert_nothing_held(s)


def evicted_to_disk(s: Scheduler, runner: FakeRunner) -> list[int]:
    """``a``'s 9 cached blocks pushed out by ``b``'s 10: on a 4-slot host, the first
    four of them stay on the host and the last five go on to disk (eviction takes a
    freed request's blocks tail first).  Returns a's prompt."""
    prompt = list(range(1, 41))
    run(s, runner, [req("a", prompt)])
    run(s, runner, [req("b", list(range(500, 540)))])
    tier = s.offload
    assert tier is not None and tier.disk is not None
    keys = s.kv.block_keys(req("k", prompt), 9)
    assert all(k in tier for k in keys[:4]) and all(k in tier.disk for k in keys[4:])
    return prompt


def test_stats_count_disk_tokens_and_bytes() -> None:
    # An 8-token budget: a step evicts at most 3 blocks, which the host pool can take.
    s = make(num_blocks=12, host_blocks=4, disk_blocks=32, budget=8)
    runner = FakeRunner(BS, pool=s.kv.pool)
    prompt = evicted_to_disk(s, runner)
    r = req("a2", prompt)
    s.add_request(r)
    tot: Counter[str] = Counter()
    while s.has_unfinished_requests():
        so = s.schedule()
        st_ = s.update_from_output(so, runner.execute_model(so)).scheduler_stats
        assert st_ is not None
        tot.update(q=st_.kv_offload_queries, h=st_.kv_offload_hits,
                   dq=st_.kv_offload_disk_queries, dh=st_.kv_offload_disk_hits,
                   to_disk=st_.kv_offload_bytes_to_disk,
                   from_disk=st_.kv_offload_bytes_from_disk)
    assert r.num_cached_tokens == 36  # 9 full blocks, from the host and from disk
    # Every hit counts once, as an external hit, and the disk's also as disk hits
    # (bringing the first ones in pushes later host-held ones out to disk).
    assert (tot["q"], tot["h"]) == (36, 36)
    assert 5 * BS <= tot["dh"] <= tot["dq"] <= 36
    assert tot["from_disk"] == tot["dh"] // BS * 100 and tot["to_disk"] > 0
    assert_nothing_held(s)


def test_disk_lru_order_pins_and_inclusion_unit() -> None:
    d = DiskTier(3)
    for i, k in enumerate("abc"):
        d.save(k, host_slot=i)
    saves, loads = d.take_copies()
    assert [h for h, _ in saves] == [0, 1, 2] and not loads
    assert d.keys() == ["a", "b", "c"]
    d.save("a", host_slot=5)  # already on disk: touched, no write
    assert d.keys() == ["b", "c", "a"] and d.take_copies() == ([], [])
    d.save("x", host_slot=0)  # evicts the least recently used: b
    assert "b" not in d and d.keys() == ["c", "a", "x"]
    d.load("c", host_slot=7)  # pinned this step, and kept on disk (inclusive)
    d.save("y", host_slot=1)  # c is pinned (read), x is pinned (written): a goes
    assert d.keys() == ["x", "c", "y"]
    d.save("z", host_slot=2)  # every slot pinned: z is lost
    assert "z" not in d
    d.check_invariants()
    saves, loads = d.take_copies()
    assert len(saves) == 2 and loads == [(d.slot_of("c"), 7)]
    assert len(set(d.slot_of(k) for k in d.keys())) == 3


def test_promotion_through_disk_unit() -> None:
    """Keys the host evicted come back from disk: each takes a host slot (whose key is
    saved to disk first), with a disk load into it and a host load out of it in the
    same step; a promotion leaves a host slot per device block it may evict, so on a
    2-slot host it moves one block a step and the request waits until all are in."""
    pool = BlockPool(8, enable_caching=True)
    kv = KVCacheManager(8, BS, enable_caching=True, pool=pool)
    tier = OffloadTier(pool, [kv], 2, DiskTier(8))
    assert tier.disk is not None

    def cached(rid: str, first: int) -> list:
        r = req(rid, list(range(first, first + 9)))  # 2 full blocks + 1 token
        assert kv.allocate_slots(r, 9) is not None
        r.num_computed_tokens = 9
        keys = kv.block_keys(r, 2)
        kv.free(r)
        return keys

    a, x = cached("a", 1), cached("x", 100)
    taken = []
    for _ in range(7):  # one eviction a step: a's keys to the host, then on to disk
        taken += pool.get_new_blocks(1)
        tier.take_copies()
        tier.check_invariants()
    assert all(k in tier.disk and k not in tier for k in a)
    assert all(k in tier and k not in tier.disk for k in x)
    pool.free_blocks(taken)
    a2 = req("a2", list(range(1, 10)))
    for i, key in enumerate(a):
        disk_slot = tier.disk.slot_of(key)
        # One block a step (two host slots, each a disk load's staging): a2 waits for
        # the second, and runs in the step that brings it.
        assert tier.promote(a2) is (i < len(a) - 1)
        tier.check_invariants()
        offload, load = tier.take_copies()
        saves, disk_loads = tier.disk_copies
        ((host, dev),) = load
        assert not offload and disk_loads == [(disk_slot, host)]
        ((saved_from, _),) = saves  # the host slot's old key (one of x's) went to disk
        assert saved_from == host and sum(k in tier.disk for k in x) == i + 1
        assert pool.get_cached_block(key) is pool.blocks[dev] and tier.slot_of(key) == host
        assert key in tier.disk  # inclusive: the disk keeps its copy
    assert not tier.promote(a2)  # every block on the device
    tier.check_invariants()


def test_abort_while_a_disk_load_is_in_flight_leaks_nothing() -> None:
    s = make(num_blocks=12, host_blocks=4, disk_blocks=32, budget=8)
    runner = FakeRunner(BS, pool=s.kv.pool)
    prompt = evicted_to_disk(s, runner)
    s.add_request(req("a2", prompt))
    assert s.offload is not None
    for _ in range(10):  # the host-held blocks come first, then the disk's
        so = s.schedule()
        if so.kv_disk_load:
            break
        s.update_from_output(so, runner.execute_model(so))
    assert so.kv_disk_load and s.offload.loading == {"a2"}
    s.finish_requests(["a2"])
    s.update_from_output(so, runner.execute_model(so))
    assert_nothing_held(s) and not s.offload._carried
    a3 = req("a3", prompt)
    run(s, runner, [a3])
    assert a3.num_cached_tokens == 36  # the rest comes from the host and disk again
    assert_nothing_held(s)


def test_reset_forgets_the_disk_and_off_without_host() -> None:
    s = make(num_blocks=12, host_blocks=2, disk_blocks=32)
    runner = FakeRunner(BS)
    run(s, runner, [req("a", list(range(1, 33)))])
    run(s, runner, [req("b", list(range(500, 532)))])
    assert disk_of(s).num_used > 0
    assert s.reset_prefix_cache() and disk_of(s).num_used == 0
    disk_of(s).check_invariants()
    assert make(host_blocks=0).offload is None  # no host tier: no disk tier either
    assert make(disk_blocks=0).offload.disk is None  # type: ignore[union-attr]


class DiskTierMachine(TierMachine):
    """The host tier's state machine (add / step / abort -- preferably of a request
    waiting for the step's loads, disk loads included -- / preempt / drain) on a
    12-block device pool, a 3-slot host pool and an 8-slot disk pool.  Adds: every disk
    slot free or holding one key, no key in two slots, and every disk slot holding
    exactly the tokens its key names."""

    @precondition(lambda self: self.s is None)
    @rule(swap=st.booleans())
    def start(self, swap: bool) -> None:
        self.s = make(num_blocks=12, host_blocks=3, disk_blocks=8, budget=16, max_seqs=4,
                      mode="swap" if swap else "recompute", cpu_blocks=6 if swap else 0)
        self.runner = FakeRunner(BS, pool=self.s.kv.pool)

    @invariant()
    def disk_consistent(self) -> None:
        s, runner = self.s, self.runner
        if s is None or runner is None:
            return
        disk = disk_of(s)
        disk.check_invariants()
        slots = [disk.slot_of(k) for k in disk.keys()]
        assert len(set(slots)) == len(slots), "two keys in one disk slot"
        for key in disk.keys():
            want = self.key_tokens.get(key)
            slot = disk.slot_of(key)
            if want is not None and slot in runner.disk:
                assert tuple(runner.disk[slot]) == want, "disk slot holds other KV"


DiskTierMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_disk_tier_state_machine = DiskTierMachine.TestCase


def test_metrics_expose_the_disk_tier() -> None:
    from prometheus_client import generate_latest

    from pagedllm.messages import SchedulerStats
    from pagedllm.metrics import EngineMetrics

    m = EngineMetrics("m", process_collectors=False)
    text = generate_latest(m.registry).decode()
    assert 'pagedllm:kv_offload_disk_total_blocks{engine="0",model_name="m"} 0.0' in text
    m.record_stats(SchedulerStats(kv_offload_total_blocks=8, kv_offload_disk_total_blocks=64,
                                  kv_offload_disk_queries=48, kv_offload_disk_hits=32,
                                  kv_offload_bytes_to_disk=4096,
                                  kv_offload_bytes_from_disk=2048,
                                  kv_offload_disk_usage=0.5))
    text = generate_latest(m.registry).decode()
    lbl = 'engine="0",model_name="m"'
    for line in (f'pagedllm:kv_offload_disk_queries_total{{{lbl}}} 48.0',
                 f'pagedllm:kv_offload_disk_hits_total{{{lbl}}} 32.0',
                 f'pagedllm:kv_offload_disk_usage_perc{{{lbl}}} 0.5',
                 f'pagedllm:kv_offload_disk_total_blocks{{{lbl}}} 64.0',
                 f'pagedllm:kv_offload_disk_bytes_total{{direction="to_disk",{lbl}}} 4096.0',
                 f'pagedllm:kv_offload_disk_bytes_total{{direction="to_host",{lbl}}} 2048.0'):
        assert line in text, line
