"""The throughput scheduling policy (fake runner): longest-``max_tokens``-first order,
prefill paced over the decode horizon, and everything else as under FCFS."""

from __future__ import annotations

import argparse
import random

import pytest

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request_queue import LongestFirstQueue
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner
from tests.core.test_scheduler import assert_all_free, make_scheduler, req, run_to_completion


def test_queue_order_longest_first_then_arrival_preempted_ahead():
    q = LongestFirstQueue()
    for rid, max_tokens, arrival in [("a", 8, 0.0), ("b", 32, 1.0), ("c", 16, 2.0),
                                     ("d", 32, 3.0), ("e", 32, 3.0)]:
        q.add(req(rid, 4, max_tokens, arrival=arrival))
    assert [r.request_id for r in q] == ["b", "d", "e", "c", "a"]
    # Preempted requests go ahead of everything, the latest preempted first (as FCFS).
    p1, p2 = req("p1", 4, 2, arrival=9.0), req("p2", 4, 1, arrival=8.0)
    q.add_preempted(p1)
    q.add_preempted(p2)
    assert [r.request_id for r in q] == ["p2", "p1", "b", "d", "e", "c", "a"]
    assert q.peek() is p2 and q.pop() is p2 and len(q) == 6
    q.remove(p1)
    q.remove(next(r for r in q if r.request_id == "e"))
    assert [q.pop().request_id for _ in range(len(q))] == ["b", "d", "c", "a"]
    assert q._tokens == 0 and q.longest_remaining_output() == 0


def test_paced_rate_meets_every_deadline():
    q = LongestFirstQueue()
    q.add(req("long", 100, 50))  # must start now: deadline 50 - 50 = 0
    q.add(req("mid", 300, 40))  # by step 10
    q.add(req("short", 100, 10))  # by step 40
    # The first deadline is now: all of "long" (and the 20 running prompt tokens first).
    assert q.paced_rate(20, horizon=50, limit=10_000) == 120
    # With 20 steps of slack for "long": 100/20 = 5, 400/30 -> 14, 500/60 -> 9.
    assert q.paced_rate(0, horizon=70, limit=10_000) == 14
    # Never below the running prompt tokens, which go first.
    assert q.paced_rate(20, horizon=70, limit=10_000) == 20
    # Capped: the scan stops at the limit, since no more would be granted anyway.
    assert q.paced_rate(20, horizon=50, limit=60) >= 60


def _chat_like(s, n=64, max_tokens=128):
    rng = random.Random(1)
    for i in range(n):
        s.add_request(req(f"c{i}", rng.randint(30, 50), max_tokens, arrival=float(i),
                          first=1 + 7 * i))


def test_equal_max_tokens_prefills_everything_now_like_fcfs():
    """Every deadline is step 0 when all requests want the same output length: the rule
    degenerates to "prefill everything now", and the run is FCFS's, step for step."""
    runs = {}
    for policy in ("fcfs", "throughput"):
        s = make_scheduler(num_blocks=64 * 180 // 4 + 1, budget=512, max_seqs=64,
                           policy=policy)
        _chat_like(s)
        runner = FakeRunner()
        outs, _ = run_to_completion(s, runner)
        assert runner.steps[0].total_num_scheduled_tokens == 512  # the whole budget
        runs[policy] = runner.steps, outs
        assert_all_free(s)
    assert runs["throughput"] == runs["fcfs"]


class _LightRunner:
    """Samples token 7 once a request's prompt is computed: enough for a pool that never
    preempts, and much cheaper than ``FakeRunner``'s KV simulation at W1 sizes."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not so.preempted_req_ids
        self.steps.append(so)
        for nr in so.new_reqs:
            self.left[nr.req_id] = len(nr.prompt_token_ids) - nr.num_computed_tokens
        toks = []
        for rid, n in so.num_scheduled_tokens.items():
            self.left[rid] -= n
            toks.append([7] if self.left[rid] <= 0 else [])
        return ModelRunnerOutput(list(so.num_scheduled_tokens), toks)


def _w1_like(policy: str, seed: int, step_sizes: tuple[int, ...] = ()):
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=64 * 1600 // 16 + 1, block_size=16, budget=8192,
                       max_seqs=64, policy=policy, max_model_len=2048)
    s._step_sizes = list(step_sizes)  # as Scheduler(..., fill_step_sizes=...) sets it
    max_tokens = {}
    for i in range(64):
        plen, olen = rng.randint(128, 1024), rng.randint(32, 512)
        s.add_request(req(f"r{i}", plen, olen, arrival=float(i), first=1 + i))
        max_tokens[f"r{i}"] = olen
    runner = _LightRunner()
    outs, finish = run_to_completion(s, runner)  # type: ignore[arg-type]
    assert {rid: len(t) for rid, t in outs.items()} == max_tokens
    assert set(finish.values()) == {"length"}
    assert_all_free(s)
    return runner.steps, max_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_w1_mix_longest_first_paced_prefill_no_longer_run(seed):
    steps, max_tokens = _w1_like("throughput", seed)
    fcfs_steps, _ = _w1_like("fcfs", seed)
    longest = max(max_tokens, key=lambda rid: (max_tokens[rid], -int(rid[1:])))
    assert next(iter(steps[0].num_scheduled_tokens)) == longest
    # Prefill is spread out: after the first steps no step comes near the budget
    # (FCFS fills four whole steps of 8192 first).
    assert max(so.total_num_scheduled_tokens for so in steps[2:]) <= 8192 // 4
    assert sum(so.total_num_scheduled_tokens == 8192 for so in fcfs_steps) >= 3
    # ... and pacing never lengthens the run: about max(max_tokens) steps, no more
    # than FCFS needs.
    assert len(steps) <= max(max_tokens.values()) + 2
    assert len(steps) <= len(fcfs_steps) + 2


# The chunk-graph sizes the engine captures by default (worker/cuda_graphs.py).
_SIZES = (8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
          1280, 1536, 1792, 2048)


@pytest.mark.parametrize("seed", [0, 1])
def test_paced_steps_fill_the_graph_sizes_and_pace_running_chunks(seed):
    """With the runner's chunk-graph sizes known, a step that takes prompt tokens while
    requests wait is filled up to a graph size (the padding it would compute anyway
    does work), and a prompt cut into chunks is finished at the pace too, not in the
    next step whatever its size: no step after the first is far above the pace."""
    steps, max_tokens = _w1_like("throughput", seed, _SIZES)
    plain, _ = _w1_like("throughput", seed)
    waiting_left = [i for i, so in enumerate(steps) if so.new_reqs]
    last_admission = max(waiting_left)
    for so in steps[:last_admission]:
        prompt = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
        if prompt:
            assert so.total_num_scheduled_tokens in _SIZES, so.total_num_scheduled_tokens
    # 64 requests of ~576 prompt tokens over ~480 steps: ~80 prompt tokens a step, so
    # after the opening steps every step stays within a few graph sizes of that while
    # requests wait (the last admitted prompt's rest is not paced: nothing waits then).
    assert max(so.total_num_scheduled_tokens for so in steps[3:last_admission]) <= 512
    assert len(steps) <= max(max_tokens.values()) + 2
    assert len(steps) <= len(plain) + 2


def test_preemption_under_throughput_gives_fcfs_outputs():
    """A pool too small for everything: preemption, recompute and chunking behave as
    under FCFS, and every request still gets exactly its tokens."""
    outs = {}
    for policy in ("fcfs", "throughput"):
        s = make_scheduler(num_blocks=30, budget=24, max_seqs=6, policy=policy)
        for i in range(8):
            s.add_request(req(f"q{i}", 6 + 3 * i % 11, 8 + 5 * i % 17, arrival=float(i),
                              first=1 + 9 * i))
        outs[policy], _ = run_to_completion(s, FakeRunner())
        if policy == "throughput":
            assert s.total_preemptions >= 1
        assert_all_free(s)
    assert outs["throughput"] == outs["fcfs"]


def test_config_and_cli_accept_throughput():
    with pytest.raises(ValueError, match="'throughput'"):
        EngineArgs(scheduling_policy="lpt").create_engine_config()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    # No flag: the entry point's default (an engine's or a server's is FCFS; the
    # offline LLM's is throughput: tests/engine/test_llm_api.py).
    assert engine_args_from_cli(p.parse_args([])).scheduling_policy is None
    assert EngineArgs().create_engine_config().scheduler_config.policy == "fcfs"
    args = p.parse_args(["--scheduling-policy", "throughput"])
    assert engine_args_from_cli(args).scheduling_policy == "throughput"


def _params(kind: str, max_tokens: int) -> SamplingParams:
    return {"ignore_eos": SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            "min_tokens": SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens),
            "eos": SamplingParams(max_tokens=max_tokens),
            "stop_token": SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                         stop_token_ids=[5]),
            "stop_string": SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          stop=["x"]),
            "short_min": SamplingParams(max_tokens=max_tokens, min_tokens=1)}[kind]


@pytest.mark.parametrize("kind,known", [("ignore_eos", True), ("min_tokens", True),
                                        ("eos", False), ("stop_token", False),
                                        ("stop_string", False), ("short_min", False)])
def test_length_known_only_when_nothing_can_stop_the_request_early(kind, known):
    r = Request("a", [1, 2, 3], _params(kind, 8), eos_token_id=2)
    assert r.length_known is known


def _mixed(policy: str, kinds: list[str], seed: int = 0):
    """A W1-like batch whose requests are of the given kinds (cycled); the runner samples
    token 7, which stops none of them (eos and stop token are other ids)."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=48 * 1600 // 16 + 1, block_size=16, budget=2048,
                       max_seqs=48, policy=policy, max_model_len=2048)
    for i in range(48):
        plen, olen = rng.randint(64, 512), rng.randint(16, 256)
        sp = _params(kinds[i % len(kinds)], olen)
        s.add_request(Request(f"r{i}", list(range(1 + i, 1 + i + plen)), sp,
                              eos_token_id=2, arrival_time=float(i)))
    runner = _LightRunner()
    outs, _ = run_to_completion(s, runner)  # type: ignore[arg-type]
    assert_all_free(s)
    return runner.steps, outs


def test_requests_of_unknown_length_run_as_under_fcfs():
    """A batch whose requests may stop at EOS or a stop token (their max_tokens is only
    a bound) is not reordered or paced: the run is FCFS's, step for step."""
    for kinds in (["eos"], ["stop_token", "eos", "stop_string"]):
        assert _mixed("throughput", kinds) == _mixed("fcfs", kinds)


def test_requests_of_unknown_length_go_first_and_are_never_paced():
    """Mixed with requests of known length, the others are admitted first, in arrival
    order, with their whole prompts as budget allows; the known ones are then paced."""
    steps, outs = _mixed("throughput", ["ignore_eos", "eos"])
    fcfs_steps, fcfs_outs = _mixed("fcfs", ["ignore_eos", "eos"])
    assert outs == fcfs_outs
    admitted = [nr.req_id for so in steps for nr in so.new_reqs]
    unknown = [f"r{i}" for i in range(1, 48, 2)]
    assert admitted[:24] == unknown
    # Not paced: each of their prompts is computed no later than under FCFS (where
    # they alternate with the known ones), and the run is no longer.
    done, fcfs_done = _prompt_done_step(steps), _prompt_done_step(fcfs_steps)
    assert all(done[rid] <= fcfs_done[rid] for rid in unknown)
    assert max(done[rid] for rid in unknown) < max(done.values())  # the others paced
    assert len(steps) <= len(fcfs_steps) + 2


def _prompt_done_step(steps: list[SchedulerOutput]) -> dict[str, int]:
    """The step at which each request's prompt was fully computed."""
    left: dict[str, int] = {}
    done: dict[str, int] = {}
    for i, so in enumerate(steps):
        for nr in so.new_reqs:
            left[nr.req_id] = len(nr.prompt_token_ids)
        for rid, n in so.num_scheduled_tokens.items():
            if rid not in done:
                left[rid] -= n
                if left[rid] <= 0:
                    done[rid] = i
    return done
