"""Per-step host cost of the engine's bookkeeping (no model: a fake runner).

Usage:
  python benchmarks/scheduler_cost.py            # both modes
  python benchmarks/scheduler_cost.py growth     # per-step time vs. sequence length
  python benchmarks/scheduler_cost.py w1 [--sync] [--repeats N] [--profile] \
      [--policy fcfs|priority|throughput] [--layers llama|gemma3]

``growth``: 64 running decode requests; times ``schedule()`` + ``update_from_output()``
per step at several sequence lengths -- the per-step time must stay flat as sequences grow.

``w1``: the W1-small workload (256 requests, prompts 128..1024 tokens, 32..512 output
tokens, greedy, ignore_eos, all submitted at once, ``max_num_batched_tokens=8192``,
``max_num_seqs=256``, prefix caching on) driven through the engine core's step loop
(async scheduling as on CUDA unless ``--sync``) and the frontend's output processor
(no tokenizer, as the dummy-model benchmark runs), with a runner that costs nothing.
Reports the host time per engine step of each phase; this is the host work that has to
hide behind the GPU's forward pass.  ``--policy`` picks the scheduling policy (FCFS by
default); ``throughput`` also changes the number of steps.  ``--layers gemma3`` gives the
KV manager Gemma-3-12B's layers (48: 5 sliding-window-1024 to 1 full), i.e. six KV cache
groups (core/hybrid_kv_cache_manager.py), instead of one.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from pagedllm.benchmarks.workloads import w1
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.messages import EngineCoreOutputs
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def growth() -> None:
    n_req, max_len = 64, 16384
    s = Scheduler(SchedulerConfig(max_num_seqs=n_req, max_num_batched_tokens=8192,
                                  max_model_len=max_len),
                  CacheConfig(block_size=16), num_blocks=n_req * max_len // 16 + 1)
    sp = SamplingParams(temperature=0.0, max_tokens=max_len - 64, ignore_eos=True)
    for i in range(n_req):
        s.add_request(Request(str(i), list(range(1, 33)), sp, eos_token_id=None))
    checkpoints = {64, 1024, 4096, 12288}
    step, samples = 0, []
    print(f"{'tokens/request':>15}{'us/step (median of 200)':>26}")
    while step < max(checkpoints) + 200:
        t0 = time.perf_counter()
        so = s.schedule()
        out = ModelRunnerOutput(list(so.num_scheduled_tokens),
                                [[7] for _ in so.num_scheduled_tokens])
        s.update_from_output(so, out)
        dt = time.perf_counter() - t0
        step += 1
        if any(c <= step < c + 200 for c in checkpoints):
            samples.append(dt)
            if len(samples) == 200:
                print(f"{step - 200 + 32:>15}{1e6 * statistics.median(samples):>26.0f}")
                samples = []


class _NullRunner:
    """Samples token 7 for every request whose prompt is computed by the end of the step.

    Valid while nothing is preempted or forked (W1 on a pool that holds it all): then a
    request samples exactly when its scheduled chunk reaches the end of its prompt, and
    on every step after that.
    """

    def __init__(self) -> None:
        self.left: dict[str, int] = {}  # prompt tokens not yet computed

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not so.preempted_req_ids and not so.forks, "the null runner cannot recompute"
        for nr in so.new_reqs:
            self.left[nr.req_id] = len(nr.prompt_token_ids) - nr.num_computed_tokens
        for rid in so.finished_req_ids:
            self.left.pop(rid, None)
        ids = list(so.num_scheduled_tokens)
        toks: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            left = self.left[rid] = self.left[rid] - n
            toks.append([7] if left <= 0 else [])
        return ModelRunnerOutput(ids, toks)


def _cache_config(layers: str) -> CacheConfig:
    groups = None
    if layers == "gemma3":
        groups = make_kv_cache_groups([None if i % 6 == 5 else 1024 for i in range(48)])
    return CacheConfig(block_size=16, enable_prefix_caching=True, kv_cache_groups=groups)


def _run_w1(sync: bool, policy: str = "fcfs",
            layers: str = "llama") -> tuple[int, dict[str, float]]:
    """One W1-small run; returns (engine steps, seconds spent per phase)."""
    reqs = w1(256, vocab_hi=49000)
    max_len = 2048
    cc = _cache_config(layers)
    groups = len(cc.kv_cache_groups.groups) if cc.kv_cache_groups is not None else 1
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                  max_model_len=max_len, async_scheduling=not sync,
                                  policy=policy),  # type: ignore[arg-type]
                  cc, num_blocks=256 * max_len // 16 * groups + 1)  # holds all of W1
    op = OutputProcessor(None)
    runner = _NullRunner()
    t = dict.fromkeys(("add", "requires_sync", "schedule", "execute", "update",
                       "process_outputs"), 0.0)
    pc = time.perf_counter
    t0 = pc()
    for i, r in enumerate(reqs):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
        op.add_request(str(i), None, r.prompt_token_ids, sp)
        s.add_request(Request(str(i), r.prompt_token_ids, sp, eos_token_id=2))
    t["add"] += pc() - t0
    inflight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    steps = 0
    n_out = 0
    while op.has_unfinished_requests():
        # EngineCore.step(), with the runner's result ready at once.
        t0 = pc()
        need_sync = s.requires_sync()
        t1 = pc()
        t["requires_sync"] += t1 - t0
        outs: EngineCoreOutputs | None = None
        if need_sync and inflight is not None:
            so, mo = inflight
            inflight = None
            outs = s.update_from_output(so, mo)
            t["update"] += pc() - t1
        else:
            so = s.schedule()
            t2 = pc()
            mo = runner.execute(so)
            t3 = pc()
            t["schedule"] += t2 - t1
            t["execute"] += t3 - t2
            if need_sync:
                outs = s.update_from_output(so, mo)
            else:
                prev, inflight = inflight, (so, mo)
                if prev is not None:
                    outs = s.update_from_output(*prev)
                    if not s.has_unfinished_requests():
                        outs.outputs.extend(s.update_from_output(*inflight).outputs)
                        inflight = None
            t["update"] += pc() - t3
        steps += 1
        if outs is not None:
            t4 = pc()
            res = op.process_outputs(outs)
            t["process_outputs"] += pc() - t4
            n_out += sum(len(o.outputs[0].token_ids) for o in res.request_outputs)
    assert n_out == sum(r.output_len for r in reqs), (n_out, "tokens lost")
    return steps, t


def w1_mode(sync: bool, repeats: int, profile: bool, policy: str = "fcfs",
            layers: str = "llama") -> None:
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        _run_w1(sync, policy, layers)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(45)
        return
    runs = [_run_w1(sync, policy, layers) for _ in range(repeats)]
    steps = runs[0][0]
    print(f"W1-small, fake runner, {layers} layers, {'sync' if sync else 'async'} "
          f"scheduling, {policy}: "
          f"{steps} steps; best of {repeats}")
    print(f"{'phase':>16}{'total ms':>10}{'us/step':>10}")
    total = 0.0
    for phase in runs[0][1]:
        best = min(r[1][phase] for r in runs)
        total += best if phase != "execute" else 0.0
        print(f"{phase:>16}{1e3 * best:>10.1f}{1e6 * best / steps:>10.0f}")
    print(f"{'host (no exec)':>16}{1e3 * total:>10.1f}{1e6 * total / steps:>10.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["growth", "w1", "all"], default="all")
    p.add_argument("--sync", action="store_true", help="w1: synchronous scheduling")
    p.add_argument("--repeats", type=int, default=5, help="w1: runs (best is shown)")
    p.add_argument("--profile", action="store_true", help="w1: cProfile one run instead")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "throughput"],
                   help="w1: scheduling policy")
    p.add_argument("--layers", default="llama", choices=["llama", "gemma3"],
                   help="w1: one KV cache group (llama) or Gemma-3-12B's six (default: "
                        "llama)")
    args = p.parse_args()
    if args.mode in ("growth", "all"):
        growth()
    if args.mode in ("w1", "all"):
        w1_mode(args.sync, args.repeats, args.profile, args.policy, args.layers)


if __name__ == "__main__":
    main()
