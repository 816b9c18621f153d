"""Draft/rollback bookkeeping with a fake runner that verifies drafts: outputs equal
decoding without drafts, KV survives rollback, and no block leaks (property test)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.spec_decode.config import SpeculativeConfig
from tests.core.fake_runner import FakeRunner, fake_token
from tests.core.test_scheduler import assert_all_free, req, run_to_completion

K = 3


class SpecFakeRunner:
    """The fake model of ``fake_runner.py`` with verification: it proposes ``K`` drafts
    of which a random number are the model's own continuation, accepts the agreeing
    prefix and emits one more token; every computed position is written into the
    simulated KV cache and re-read through the block table after each step."""

    def __init__(self, seed: int, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.max_tokens: dict[str, int] = {}

    def _continuation(self, toks: list[int], n: int) -> list[int]:
        out = list(toks)
        for _ in range(n):
            out.append(fake_token(out, None))
        return out[len(toks):]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self.blocks.pop(rid, None)
            if rid not in sched.preempted_req_ids:
                self.tokens.pop(rid, None)
        for nr in sched.new_reqs:
            self.tokens[nr.req_id] = nr.prompt_token_ids + nr.output_token_ids
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.blocks[nr.req_id] = list(nr.block_ids)
        for c in sched.cached_reqs:
            assert self.computed[c.req_id] == c.num_computed_tokens, "rollback mismatch"
            self.blocks[c.req_id].extend(c.new_block_ids)
        out = ModelRunnerOutput(list(sched.num_scheduled_tokens), [])
        for rid, n in sched.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            seq = toks + drafts
            start = self.computed[rid]
            assert start + n <= len(seq), "scheduled beyond known tokens and drafts"
            for pos in range(start, start + n):
                b = self.blocks[rid][pos // self.bs]
                self.kv.setdefault(b, [None] * self.bs)[pos % self.bs] = seq[pos]
            if start + n < len(toks):
                self.computed[rid] = start + n
                out.sampled_token_ids.append([])
                continue
            a = 0
            while a < len(drafts) and drafts[a] == fake_token(toks + drafts[:a], None):
                a += 1
            emitted = drafts[:a] + [fake_token(toks + drafts[:a], None)]
            toks.extend(emitted)
            self.computed[rid] = len(toks) - 1
            out.sampled_token_ids.append(emitted)
            good = self.rng.randint(0, K)
            prop = self._continuation(toks, good) + [7] * (K - good)
            out.spec_token_ids[rid] = prop[:self.rng.randint(0, K)]
        for rid in sched.num_scheduled_tokens:
            toks = self.tokens[rid]
            for pos in range(self.computed[rid]):
                b = self.blocks[rid][pos // self.bs]
                assert self.kv[b][pos % self.bs] == toks[pos], f"{rid}: KV {pos} lost"
        return out


def spec_scheduler(num_blocks: int, caching: bool, policy: str = "fcfs",
                   disable_by_batch_size: int = 8, budget: int = 24) -> Scheduler:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": K,
                                        "disable_by_batch_size": disable_by_batch_size})
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=256,
                        policy=policy, speculative_config=spec),  # type: ignore[arg-type]
        CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks)


def test_outputs_equal_decoding_without_drafts_and_counts_accepted():
    prompts = [("a", 9, 20), ("b", 5, 17), ("c", 14, 11)]
    plain = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24,
                                      max_model_len=256),
                      CacheConfig(block_size=4, enable_prefix_caching=True), 64)
    for rid, plen, mt in prompts:
        plain.add_request(req(rid, plen, mt))
    want, _ = run_to_completion(plain, FakeRunner())
    s = spec_scheduler(64, caching=True)
    for rid, plen, mt in prompts:
        s.add_request(req(rid, plen, mt))
    accepted = 0
    runner = SpecFakeRunner(0)
    got: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= 24
        eco = s.update_from_output(so, runner.execute_model(so))
        accepted += eco.scheduler_stats.spec_num_accepted_tokens
        for o in eco.outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == want
    assert accepted > 0
    assert_all_free(s)


def test_policy_no_drafts_above_disable_by_batch_size():
    s = spec_scheduler(64, caching=False, disable_by_batch_size=1)
    for rid in "ab":
        s.add_request(req(rid, 4, 8))
    runner = SpecFakeRunner(1)
    while s.has_unfinished_requests():
        so = s.schedule()
        assert not so.scheduled_spec_decode_tokens or len(s.running) <= 1
        s.update_from_output(so, runner.execute_model(so))
    assert_all_free(s)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                          st.integers(1, 30), st.integers(1, 20)),
                min_size=1, max_size=50),
       st.integers(8, 40), st.booleans(), st.integers(0, 1000),
       st.sampled_from(["fcfs", "throughput"]))
def test_property_drafts_and_rollback_leak_no_blocks(ops, num_blocks, caching, seed, policy):
    s = spec_scheduler(num_blocks, caching, policy)
    runner = SpecFakeRunner(seed)
    n = 0
    live: list[str] = []
    for op, plen, mtok in ops:
        if op == "add":
            rid = f"q{n}"
            n += 1
            try:
                s.add_request(req(rid, plen, mtok, arrival=float(n), first=n % 5 + 1))
                live.append(rid)
            except ValueError:
                pass
        elif op == "abort" and live:
            s.finish_requests([live.pop(plen % len(live))])
        else:
            so = s.schedule()
            s.update_from_output(so, runner.execute_model(so))
            for r in s.running:  # the scheduler's count is what the runner computed
                assert r.num_computed_tokens == runner.computed[r.request_id]
        pool = s.kv.pool
        in_use = sum(len(b) for b in s.kv.req_to_blocks.values())
        assert sum(b.ref_cnt for b in pool.blocks[1:]) == in_use
        assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        s.update_from_output(so, runner.execute_model(so))
    assert_all_free(s)


def test_step_period_sync_async_and_idle():
    from pagedllm.spec_decode.scheduling import _period

    assert _period(10.0, None, 12.0) == 2.0  # the first step: its own time
    assert _period(10.0, 9.5, 12.0) == 2.5  # synchronous: from the previous output
    assert _period(10.0, 5.0, 12.0) == 2.0  # after an idle gap longer than the step
    assert _period(10.0, 11.0, 12.0) == 1.0  # in flight with the previous: the period


def test_plain_steps_timed_only_in_steady_state():
    """A plain step right after a speculating (synchronous) one is not what plain
    decoding costs under async scheduling: the policy is given only plain steps that
    follow a plain step, and speculating steps that verify and propose."""
    from pagedllm.spec_decode.policy import StepCostCurve
    from pagedllm.spec_decode.scheduling import SpecScheduling

    curve = StepCostCurve(((8, 1.0),), ((8, 1.0), (64, 1.0)), True, "flat")
    sched = SpecScheduling(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                           curve)
    timed: list[bool] = []
    real = sched.policy.observe_time
    sched.policy.observe_time = lambda ms, n, t, verify: (timed.append(verify),
                                                         real(ms, n, t, verify))
    # (drafts verified, proposed): spec, spec, verify-only, plain, plain, plain, switch-on
    for drafts, proposed in ((32, True), (32, True), (32, False), (0, False), (0, False),
                             (0, False), (0, True)):
        sched._t0.append(0.0)
        sched.end_step(8, 8 + drafts, drafts, proposed)
    assert timed == [True, True, False, False]
