"""Why does W4's TTFT vary between runs?  Times many 1-token requests (512-token prompts)
one by one and splits each into GPU-busy time and the rest.

Usage: python benchmarks/ttft_probe.py [--trials 12] [--out DIR]

Phases, each over ``--trials`` fresh prompts:

1. as ``pagedllm bench latency`` runs them (garbage collector on);
2. after ``gc.collect(); gc.freeze()`` with the collector disabled, to see whether
   collections landing in the timed call explain the slow trials;
3. under ``torch.profiler`` (CUDA kernels only): per trial, the sum of kernel times and
   the span from the first kernel's start to the last kernel's end, against wall time;
4. with ``--cprofile``: the host's functions over ``--trials`` requests (by own time),
   written to ``ttft_host.txt``.

Prints one line per trial and writes ``ttft_probe.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch

from pagedllm import LLM
from pagedllm.benchmarks.latency import _timed
from pagedllm.benchmarks.workloads import w4, write_dummy_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--out", default=".")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--dummy", default="llama3-8b", choices=["llama3-8b", "smollm2-135m"])
    a = ap.parse_args()
    llm = LLM(write_dummy_model(a.dummy), load_format="dummy", skip_tokenizer_init=True)
    hi = 49000 if a.dummy == "smollm2-135m" else 128000
    _timed(llm, w4(100, hi), 8)  # warm-up, as bench latency does
    seeds = iter(range(1000, 2000))
    res: dict[str, list] = {"gc_on_ms": [], "gc_frozen_ms": [], "profiled": []}
    for _ in range(a.trials):
        res["gc_on_ms"].append(1000 * _timed(llm, w4(next(seeds), hi), 1))
    gc.collect()
    gc.freeze()
    gc.disable()
    for _ in range(a.trials):
        res["gc_frozen_ms"].append(1000 * _timed(llm, w4(next(seeds), hi), 1))
    gc.enable()
    from torch.profiler import ProfilerActivity, profile
    for _ in range(a.trials if torch.cuda.is_available() else 0):
        prompt = w4(next(seeds), hi)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = _timed(llm, prompt, 1)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time_total for e in kernels) / 1000
        span = (max(e.time_range.end for e in kernels)
                - min(e.time_range.start for e in kernels)) / 1000 if kernels else 0.0
        res["profiled"].append({"wall_ms": 1000 * wall, "kernel_sum_ms": busy,
                                "kernel_span_ms": span, "kernels": len(kernels)})
    if a.cprofile:
        import cProfile
        import io
        import pstats
        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(a.trials):
            _timed(llm, w4(next(seeds), hi), 1)
        prof_host.disable()
        buf = io.StringIO()
        pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof_host, stream=buf).sort_stats("cumtime").print_stats(40)
        with open(os.path.join(a.out, "ttft_host.txt"), "w") as f:
            f.write(buf.getvalue())
    for key in ("gc_on_ms", "gc_frozen_ms"):
        vals = res[key]
        print(f"{key:<14} median {statistics.median(vals):7.2f}  min {min(vals):7.2f}  "
              f"max {max(vals):7.2f}  all {' '.join(f'{v:.1f}' for v in vals)}")
    for p in res["profiled"]:
        print(f"profiled wall {p['wall_ms']:7.2f} ms  kernels {p['kernels']:5d}  "
              f"sum {p['kernel_sum_ms']:7.2f} ms  first-to-last {p['kernel_span_ms']:7.2f} ms")
    with open(os.path.join(a.out, "ttft_probe.json"), "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
