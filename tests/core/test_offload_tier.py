"""The prefix cache's host tier (core/offload_tier.py) on the scheduler with a fake runner:
evicted cached blocks go to the host and come back on a hit with the KV they held;
outputs equal prefix caching off; hits counted; and -- a Hypothesis state machine over
add / step / abort (also while loads are in flight) / preempt on a device pool too small
for the working set -- no block or host slot is ever leaked, doubled or corrupted."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.offload_tier import OffloadTier
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner

BS = 4


def make(num_blocks=24, host_blocks=64, caching=True, budget=32, mode="recompute",
         cpu_blocks=0, groups=None, max_seqs=8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                        max_model_len=256, preemption_mode=mode),
        CacheConfig(block_size=BS, enable_prefix_caching=caching,
                    num_offload_blocks=host_blocks, kv_offload_block_bytes=100,
                    kv_cache_groups=groups),
        num_blocks, cpu_blocks)


def req(rid: str, prompt: list[int], max_tokens: int = 3, **kw) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, prompt, sp, eos_token_id=None, arrival_time=0.0)


def conversation(c: int, turn: int) -> list[int]:
    """Conversation ``c``'s prompt at ``turn``: a 24-token history growing 8 a turn."""
    return [100 * (c + 1) + i for i in range(24 + 8 * turn)]


def run(s: Scheduler, runner: FakeRunner, reqs: list[Request],
        totals: Counter[str] | None = None) -> dict[str, list[int]]:
    """Run to completion; ``totals`` sums the steps' host-tier counters."""
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            return out
        so = s.schedule()
        eco = s.update_from_output(so, runner.execute_model(so))
        for o in eco.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if totals is not None and eco.scheduler_stats is not None:
            st = eco.scheduler_stats
            totals.update(queries=st.kv_offload_queries, hits=st.kv_offload_hits,
                          to_host=st.kv_offload_bytes_to_host,
                          to_device=st.kv_offload_bytes_to_device)
    raise AssertionError("did not finish")


def assert_nothing_held(s: Scheduler) -> None:
    pool = s.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    if s.offload is not None:
        s.offload.check_invariants()


def multiturn(s: Scheduler, runner: FakeRunner, convs: int = 4, turns: int = 3):
    """Round-robin turns of ``convs`` conversations, one request at a time (each turn's
    prompt extends the last); returns outputs and cached tokens per request."""
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for t in range(turns):
        for c in range(convs):
            r = req(f"c{c}t{t}", conversation(c, t))
            outs.update(run(s, runner, [r]))
            cached[r.request_id] = r.num_cached_tokens
    return outs, cached


def test_round_trip_keeps_the_kv_and_counts_hits() -> None:
    """The device pool (23 blocks) holds one conversation's history at a time; the host
    holds them all: later turns hit on the host, outputs equal caching off, and the
    runner's KV re-read (fake_runner) proves each loaded block holds its tokens."""
    ref, _ = multiturn(make(caching=False), FakeRunner(BS))
    dev, dev_cached = multiturn(make(host_blocks=0), FakeRunner(BS))
    s = make()
    runner = FakeRunner(BS, pool=s.kv.pool)
    got, cached = multiturn(s, runner)
    assert got == ref == dev
    assert sum(cached.values()) > sum(dev_cached.values())
    # Every turn after the first finds the whole previous history (2 full blocks of a
    # conversation's 28..36-token prompt minus the last token), from either tier.
    for c in range(4):
        for t in range(1, 3):
            assert cached[f"c{c}t{t}"] >= (len(conversation(c, t - 1)) // BS) * BS
    moved = [so for so in runner.steps if so.kv_load]
    assert moved and any(so.kv_offload for so in runner.steps)
    stats = s.make_stats()  # the counters of the last step only; totals over the run:
    assert stats.kv_offload_total_blocks == 64 and 0 < stats.kv_offload_usage <= 1
    assert s.offload is not None and s.offload.total_hit_blocks > 0
    assert_nothing_held(s)


def test_stats_count_tokens_once_and_bytes_each_way() -> None:
    s = make(num_blocks=12)
    runner = FakeRunner(BS)
    first, second = Counter[str](), Counter[str]()
    run(s, runner, [req("a", list(range(1, 41)))], first)  # 10 blocks, all cached
    run(s, runner, [req("b", list(range(500, 540)))], first)  # evicts a's to the host
    assert first["to_host"] >= 9 * 100 and first["to_device"] == 0
    assert first["queries"] == 36 + 36 and first["hits"] == 0  # (both missed)
    r = req("a2", list(range(1, 41)))
    run(s, runner, [r], second)
    assert r.num_cached_tokens == 36  # 9 full blocks, all from the host
    assert second["to_device"] == 9 * 100
    assert (second["queries"], second["hits"]) == (36, 36)


def test_a_block_offloaded_and_looked_up_in_one_step_round_trips() -> None:
    """``b``'s allocation evicts ``a``'s blocks and ``a2`` finds them on the host in the
    same step: offloads are applied before loads are issued, so ``a2`` reads ``a``'s KV
    in that very step."""
    s = make(num_blocks=30, budget=128)
    runner = FakeRunner(BS, pool=s.kv.pool)
    run(s, runner, [req("a", list(range(1, 25)), max_tokens=1)])  # 7 blocks, 6 cached
    run(s, runner, [req("d", list(range(300, 340)), max_tokens=1)])  # 11 more
    # Free list: 11 never used, a's 7 (tail first), d's 11: b takes the first 18.
    s.add_request(req("b", list(range(500, 572)), max_tokens=1))
    s.add_request(req("a2", list(range(1, 25)) + [7, 7], max_tokens=1))
    so = s.schedule()
    assert so.kv_offload and so.kv_load
    offloaded = {slot for _, slot in so.kv_offload}
    assert offloaded & {slot for slot, _ in so.kv_load}
    assert so.num_scheduled_tokens["a2"] == 2  # 6 blocks loaded back, 2 tokens to run
    s.update_from_output(so, runner.execute_model(so))
    run(s, runner, [])
    assert_nothing_held(s)


def test_block_pool_eviction_hook_and_promotion_unit() -> None:
    pool = BlockPool(6, enable_caching=True)
    kv = KVCacheManager(6, BS, enable_caching=True, pool=pool)
    tier = OffloadTier(pool, [kv], 4)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token
    assert kv.allocate_slots(a, 13) is not None
    a.num_computed_tokens = 13
    keys = kv.block_keys(a, 3)
    kv.free(a)
    pool.get_new_blocks(5)  # every block: a's three cached ones go to the host
    offload, load = tier.take_copies()
    assert len(offload) == 3 and not load and all(k in tier for k in keys)
    pool.free_blocks(pool.blocks[1:])
    a2 = req("a2", list(range(1, 14)))
    assert not tier.promote(a2)  # all three blocks loading: a2 may run this step
    hits, n = kv.get_computed_blocks(a2)
    assert n == 12 and [b.block_hash for b in hits] == keys
    # Held by the tier while their loads are queued: no allocation can take them, and
    # another lookup of the same prefix this step finds them as device hits.
    assert pool.num_free_blocks == 2 and all(b.ref_cnt == 1 for b in hits)
    assert not tier.promote(req("a3", list(range(1, 14))))
    tier.check_invariants()
    offload, load = tier.take_copies()
    assert not offload and sorted(s for s, _ in load) == sorted(tier.slot_of(k) for k in keys)
    assert tier.loading == {"a2"}  # a3 loaded nothing of its own
    # The next step: ordinary cached blocks; evicting them again costs no copy (the
    # host keeps its copy).
    assert pool.num_free_blocks == 5 and all(b.ref_cnt == 0 for b in hits)
    assert not tier.promote(a2)
    pool.get_new_blocks(5)
    assert tier.take_copies() == ([], []) and all(k in tier for k in keys)
    tier.check_invariants()
    # Room for one block only: the first one comes back and a2 waits a step for the
    # rest (rather than recompute them); the next step brings the other two.
    pool.free_blocks(pool.blocks[1:])
    rest = pool.get_new_blocks(4)
    assert tier.promote(a2)
    assert [s for s, _ in tier.take_copies()[1]] == [tier.slot_of(keys[0])]
    pool.free_blocks(rest)
    assert not tier.promote(a2)
    assert sorted(s for s, _ in tier.take_copies()[1]) == \
        sorted(tier.slot_of(k) for k in keys[1:])
    tier.check_invariants()


def test_host_lru_evicts_oldest_and_pins_slots_read_this_step() -> None:
    pool = BlockPool(5, enable_caching=True)
    kv = KVCacheManager(5, BS, enable_caching=True, pool=pool)
    tier = OffloadTier(pool, [kv], 2)
    for i, first in enumerate((1, 50, 90)):
        r = req(f"r{i}", list(range(first, first + 5)))
        kv.allocate_slots(r, 5)
        r.num_computed_tokens = 5
        kv.free(r)
        pool.get_new_blocks(4)
        pool.free_blocks(pool.blocks[1:])
        tier.take_copies()
    r0, r1, r2 = (req(f"x{f}", list(range(f, f + 5))) for f in (1, 50, 90))
    assert not tier.promote(r0)  # its block was the first to go: nothing to load
    assert not tier.promote(r1)
    # Both slots are now pinned: admitted now, r2's own new block would find no host
    # slot for the block it evicts, so r2 waits a step.
    assert tier.promote(r2)
    slots = (tier.slot_of(kv.block_keys(r1, 1)[0]), tier.slot_of(kv.block_keys(r2, 1)[0]))
    # A new cached block evicted now finds no slot to take: both are pinned.
    r3 = req("r3", list(range(200, 205)))
    kv.allocate_slots(r3, 5)
    r3.num_computed_tokens = 5
    (key3,) = kv.block_keys(r3, 1)
    kv.free(r3)
    pool.get_new_blocks(2)
    assert key3 not in tier
    offload, load = tier.take_copies()
    assert not offload and sorted(s for s, _ in load) == sorted(slots)
    assert tier.loading == {"x50", "x90"}
    tier.check_invariants()


def test_a_sliding_group_loads_only_its_window() -> None:
    """A full group and a window of 8 tokens (2 blocks): a 40-token history comes back
    as all 9 full-group blocks but only the sliding group's last 2 (the window of the
    36-token hit), and the hit and the answer are as with everything loaded."""
    groups = make_kv_cache_groups([None, 8])
    s = make(num_blocks=30, groups=groups, budget=64)
    runner = FakeRunner(BS, pool=s.kv.pool)
    run(s, runner, [req("a", list(range(1, 41)))])
    run(s, runner, [req("b", list(range(500, 540))), req("c", list(range(600, 640)))])
    a2 = req("a2", list(range(1, 41)))
    s.add_request(a2)
    so = s.schedule()
    keys = [s.kv.pool.blocks[d].block_hash for _, d in so.kv_load]
    sliding = [k for k in keys if isinstance(k, tuple)]  # group 1's keys carry its id
    assert (len(keys) - len(sliding), len(sliding)) == (9, 2)
    assert so.num_scheduled_tokens == {"a2": 4} and a2.num_cached_tokens == 36
    s.update_from_output(so, runner.execute_model(so))
    ref = run(make(caching=False, groups=groups), FakeRunner(BS), [req("a2", list(range(1, 41)))])
    run(s, runner, [])
    assert [*a2.output_token_ids] == ref["a2"]
    assert_nothing_held(s)


def test_hybrid_groups_and_swap_with_the_tier() -> None:
    groups = make_kv_cache_groups([None, 8, 8, None, 8, 8])
    for kw in ({"groups": groups}, {"mode": "swap", "cpu_blocks": 16}):
        ref, _ = multiturn(make(caching=False, num_blocks=40, **kw), FakeRunner(BS))
        s = make(num_blocks=40, **kw)
        runner = FakeRunner(BS, pool=s.kv.pool)
        got, cached = multiturn(s, runner)
        assert got == ref and sum(cached.values()) > 0
        assert s.offload is not None and s.offload.total_hit_blocks > 0
        assert_nothing_held(s)


def test_off_without_prefix_caching_or_host_blocks() -> None:
    assert make(caching=False).offload is None
    assert make(host_blocks=0).offload is None


class TierMachine(RuleBasedStateMachine):
    """add / step / abort / preempt (also between a step's scheduling and its execution,
    while its loads are in flight, aborting the requests waiting for them) on a 12-block
    device pool and an 8-block host pool, recompute or swap preemption.  Invariants:
    reference counts equal the tables' references (the tier holds nothing between
    steps), every host slot free or holding one hash, every cached block -- on either
    tier -- holding exactly the tokens its hash names, and (fake_runner) no step reads
    or writes a block whose load it issued."""

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None
        self.runner: FakeRunner | None = None
        self.n = 0
        self.key_tokens: dict[object, tuple[int, ...]] = {}

    @precondition(lambda self: self.s is None)
    @rule(swap=st.booleans())
    def start(self, swap: bool) -> None:
        self.s = make(num_blocks=12, host_blocks=8, budget=16, max_seqs=4,
                      mode="swap" if swap else "recompute", cpu_blocks=6 if swap else 0)
        self.runner = FakeRunner(BS, pool=self.s.kv.pool)

    @precondition(lambda self: self.s is not None)
    @rule(conv=st.integers(0, 3), turn=st.integers(0, 2), extra=st.integers(0, 5),
          max_tokens=st.integers(1, 6))
    def add(self, conv: int, turn: int, extra: int, max_tokens: int) -> None:
        assert self.s is not None
        self.n += 1
        prompt = conversation(conv, turn)[:12 + 4 * turn] + [900 + extra] * extra
        self.s.add_request(req(f"r{self.n}", prompt, max_tokens))

    @precondition(lambda self: self.s is not None)
    @rule(mid=st.sampled_from(["none", "abort", "preempt"]), pick=st.integers(0, 100))
    def step(self, mid: str, pick: int) -> None:
        """One step; ``mid``: abort a request (preferably one whose promotion issued
        the step's loads) or recompute-preempt a running one while its copies are in
        flight."""
        s, runner = self.s, self.runner
        assert s is not None and runner is not None and s.offload is not None
        so = s.schedule()
        loaders = s.offload.loading
        if so.kv_load:
            assert loaders, "loads issued for no one"
        if mid == "abort" and s.requests:
            ids = sorted(loaders) or sorted(s.requests)
            s.finish_requests([ids[pick % len(ids)]])
        elif mid == "preempt" and s.running and not s.swap.enabled:
            s._preempt(s.running[pick % len(s.running)])
        s.update_from_output(so, runner.execute_model(so))
        self._learn_keys()

    @precondition(lambda self: self.s is not None)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick: int) -> None:
        assert self.s is not None
        ids = sorted(self.s.requests)
        if ids:
            self.s.finish_requests([ids[pick % len(ids)]])

    @precondition(lambda self: self.s is not None and not self.s.swap.enabled)
    @rule()
    def preempt(self) -> None:
        """Recompute-preempt the newest running request between steps (swap victims
        move inside ``schedule`` only, where the pool runs short)."""
        s = self.s
        assert s is not None
        if s.running:
            s._preempt(s.running[-1])

    @precondition(lambda self: self.s is not None)
    @rule()
    def drain(self) -> None:
        """Every request runs to the end: both pools hold nothing referenced."""
        s, runner = self.s, self.runner
        assert s is not None and runner is not None
        for _ in range(2000):
            if not s.has_unfinished_requests():
                break
            so = s.schedule()
            s.update_from_output(so, runner.execute_model(so))
            self._learn_keys()
        assert not s.has_unfinished_requests()
        assert_nothing_held(s)
        assert not s.swap.swapped and len(s.swap.cpu_free) == s.swap.num_cpu_blocks

    def _learn_keys(self) -> None:
        """The tokens each live request's block keys name (keys are hashes)."""
        s = self.s
        assert s is not None
        for r in s.requests.values():
            n = r.num_computed_tokens // BS
            for i, k in enumerate(s.kv.block_keys(r, n)):
                self.key_tokens[k] = tuple(r.all_token_ids[i * BS:(i + 1) * BS])

    @invariant()
    def consistent(self) -> None:
        s, runner = self.s, self.runner
        if s is None or runner is None:
            return
        pool = s.kv.pool
        refs: dict[int, int] = {}
        for blocks in s.kv.req_to_blocks.values():
            for b in blocks:
                if b is not pool.null_block:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} leaked or doubled"
        assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
        tier = s.offload
        assert tier is not None
        tier.check_invariants()
        for key, slot in tier._lru.items():
            want = self.key_tokens.get(key)
            if want is not None and slot in runner.host:
                assert tuple(runner.host[slot]) == want, "host slot holds other KV"
        for key, b in pool.cached_blocks.items():
            want = self.key_tokens.get(key)
            if want is not None and b.block_id in runner.kv and b.ref_cnt == 0:
                assert tuple(runner.kv[b.block_id]) == want, "cached block holds other KV"


TierMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_tier_state_machine = TierMachine.TestCase


def test_abort_of_a_waiting_request_after_promotion_leaks_nothing() -> None:
    """A waiting request whose host hits were promoted but which was not admitted, then
    aborted: its promoted blocks stay cached on the device, referenced by no one, and
    the next request finds them there."""
    s = make(num_blocks=12)
    runner = FakeRunner(BS, pool=s.kv.pool)
    run(s, runner, [req("a", list(range(1, 33)))])
    run(s, runner, [req("b", list(range(500, 532)))])  # a's blocks go to the host
    a2 = req("a2", list(range(1, 33)))
    s.add_request(a2)
    assert s.offload is not None and not s.offload.promote(a2)  # (all of it promoted)
    s.finish_requests(["a2"], RequestStatus.FINISHED_ABORTED)
    so = s.schedule()
    assert so.kv_load  # the loads still land: the blocks are cached on the device
    s.update_from_output(so, runner.execute_model(so))
    assert_nothing_held(s)
    # Admitted on its loads and aborted while they are in flight (issued by
    # ``schedule``): likewise.
    run(s, runner, [req("d", list(range(600, 632)))])  # a's blocks back to the host
    a4 = req("a4", list(range(1, 33)))
    s.add_request(a4)
    so = s.schedule()
    assert so.kv_load and s.offload.loading == {"a4"} and "a4" in so.num_scheduled_tokens
    s.finish_requests(["a4"])
    s.update_from_output(so, runner.execute_model(so))
    assert_nothing_held(s) and not s.offload._carried
    a3 = req("a3", list(range(1, 33)))
    run(s, runner, [a3])
    assert a3.num_cached_tokens == 28
    assert_nothing_held(s)


def test_a_promoted_request_runs_in_the_step_that_loads_it() -> None:
    """A waiting request whose prefix is on the host is admitted in the step that
    issues its loads (the runner's attention waits for each layer's copies), on the
    loaded blocks as device hits, counted once as the tier's; the request behind it
    runs too."""
    s = make(num_blocks=12)
    runner = FakeRunner(BS, pool=s.kv.pool)
    run(s, runner, [req("a", list(range(1, 33)))])
    run(s, runner, [req("b", list(range(500, 532)))])  # a's blocks go to the host
    a2, c = req("a2", list(range(1, 33))), req("c", list(range(700, 705)))
    s.add_request(a2)
    s.add_request(c)
    so = s.schedule()
    assert s.offload is not None and s.offload.loading == {"a2"}
    assert so.kv_load and list(so.num_scheduled_tokens) == ["a2", "c"]
    from_host = BS * len(so.kv_load)  # (the rest of the 7 full blocks: device hits)
    assert so.num_scheduled_tokens["a2"] == 4 and a2.num_cached_tokens == 28
    loaded = {d for _, d in so.kv_load}
    assert loaded <= set(s.kv.get_block_ids("a2"))
    assert all(s.kv.pool.blocks[d].ref_cnt == 1 for d in loaded)  # a2's, not the tier's
    eco = s.update_from_output(so, runner.execute_model(so))
    st_ = eco.scheduler_stats
    assert st_ is not None
    # (c's one full block missed in both tiers)
    assert (st_.kv_offload_queries, st_.kv_offload_hits) == (from_host + BS, from_host)
    ref = run(make(caching=False), FakeRunner(BS), [req("a2", list(range(1, 33)))])
    got = run(s, runner, [])
    assert [*a2.output_token_ids] == ref["a2"] and "c" in got
    assert_nothing_held(s)


def test_cache_salt_and_lora_keep_host_entries_apart() -> None:
    """The host tier is keyed by the pool's keys, which carry the cache salt and the
    LoRA adapter: the same tokens under another salt or adapter never hit."""
    from pagedllm.lora.request import LoRARequest

    s = make(num_blocks=12)
    runner = FakeRunner(BS)
    prompt = list(range(1, 33))
    run(s, runner, [req("a", prompt, cache_salt="x")])
    run(s, runner, [req("b", list(range(500, 540)))])  # a's blocks go to the host
    other_salt = req("a2", prompt, cache_salt="y")
    lora = req("a3", prompt, cache_salt="x")
    lora.lora_request = LoRARequest("ad", 1, "/nonexistent")
    same = req("a4", prompt, cache_salt="x")
    for r in (other_salt, lora, same):
        run(s, runner, [r])
    assert other_salt.num_cached_tokens == 0 and lora.num_cached_tokens == 0
    assert same.num_cached_tokens == 28
    assert_nothing_held(s)


def test_metrics_expose_the_tier() -> None:
    from prometheus_client import generate_latest

    from pagedllm.messages import SchedulerStats
    from pagedllm.metrics import EngineMetrics

    m = EngineMetrics("m", process_collectors=False)
    m.record_stats(SchedulerStats(kv_offload_queries=64, kv_offload_hits=48,
                                  kv_offload_bytes_to_host=4096,
                                  kv_offload_bytes_to_device=1024, kv_offload_usage=0.25,
                                  kv_offload_total_blocks=40))
    text = generate_latest(m.registry).decode()
    for line in ('vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 64.0',
                 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 48.0',
                 'pagedllm:kv_offload_usage_perc{engine="0",model_name="m"} 0.25',
                 'pagedllm:kv_offload_total_blocks{engine="0",model_name="m"} 40.0'):
        assert line in text, line
    assert 'direction="to_host"' in text and "4096.0" in text and "1024.0" in text
