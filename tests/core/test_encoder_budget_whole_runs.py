"""Whole placeholder runs (``SchedulerConfig.whole_placeholder_runs``, Gemma 3: an image's
tokens attend to the whole image): no chunk ends inside a run, a prefix hit ending inside
a run computes the rest of it in one step, and every request still finishes (torch-free,
fake runner)."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner
from tests.core.test_encoder_budget import IMG, image_request


def make(budget: int, caching: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                        whole_placeholder_runs=True),
        CacheConfig(block_size=4, enable_prefix_caching=caching), 64)


def chunks(s: Scheduler, runner: FakeRunner | None = None,
           ) -> dict[str, list[tuple[int, int]]]:
    """Every request's computed ranges, step by step, until all finish."""
    runner = runner or FakeRunner()
    seen: dict[str, list[tuple[int, int]]] = {}
    for _ in range(200):
        if not s.has_unfinished_requests():
            return seen
        so = s.schedule()
        for rid, n in so.num_scheduled_tokens.items():
            start = s.requests[rid].num_computed_tokens - n
            seen.setdefault(rid, []).append((start, start + n))
        s.update_from_output(so, runner.execute_model(so))
    raise AssertionError("requests did not finish")


def assert_whole(runs: list[tuple[int, int, str]], got: list[tuple[int, int]]) -> None:
    for start, end in got:
        for off, n, _ in runs:
            if start < off + n and off < end:  # the chunk meets the run: it holds its end
                assert end >= off + n, (start, end, off, n)


def test_chunks_never_end_inside_a_run() -> None:
    runs = [(3, 6, "a"), (10, 6, "b"), (17, 4, "c")]
    s = make(budget=7)
    s.add_request(image_request("r", runs, 24))
    got = chunks(s)["r"]
    assert_whole(runs, got)
    assert got[0] == (0, 3)  # cut before run a (3 + 6 > 7)
    assert s.encoder.whole_runs


def test_without_the_flag_runs_are_split() -> None:
    runs = [(3, 6, "a")]
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7,
                                  max_model_len=256),
                  CacheConfig(block_size=4), 64)
    s.add_request(image_request("r", runs, 12))
    assert chunks(s)["r"][0] == (0, 7)


def test_a_prefix_hit_inside_a_run_computes_the_rest_whole() -> None:
    """The first request caches blocks 0..2 (run at 2..9); the second, same image, other
    text from 10 on, hits 8 tokens (inside the run) and computes 8..9 with what follows."""
    s, runner = make(budget=16, caching=True), FakeRunner()
    s.add_request(image_request("a", [(2, 8, "img")], 16))
    chunks(s, runner)
    ids = [100, 101] + [IMG] * 8 + [900 + i for i in range(6)]
    b = Request("b", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                None)
    b.mm_features = [MultiModalFeature("image", "img", 2, 8, {})]
    s.add_request(b)
    got = chunks(s, runner)["b"]
    assert got[0][0] == 8
    assert_whole([(2, 8, "img")], got)
