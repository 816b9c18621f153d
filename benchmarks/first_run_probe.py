"""Why a process's first W1 run is slower than its second: per run, the wall time, the
caching allocator's cudaMalloc / cudaFree counts and retries, Triton compilations, and
Python's garbage-collection pauses (``gc.callbacks``).

Usage (same flags as ``pagedllm bench throughput``):
  python benchmarks/first_run_probe.py --workload W1 --dummy llama3-8b --no-hf \
      --scheduling-policy throughput --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from pagedllm.benchmarks import throughput as tp
from pagedllm.kernels import compile_stats

_gc = {"n2": 0, "s": 0.0, "t0": 0.0, "max": 0.0, "n01": 0, "s01": 0.0, "max01": 0.0}


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
        return
    dt = time.perf_counter() - _gc["t0"]
    k = "" if info.get("generation") == 2 else "01"
    _gc["n2" if not k else "n01"] += 1
    _gc["s" + k] += dt
    _gc["max" + k] = max(_gc["max" + k], dt)


def main() -> None:
    p = argparse.ArgumentParser()
    tp.add_args(p)
    args = p.parse_args()
    llm = tp.build_llm(args)
    reqs = tp._requests(args, llm)
    gc.callbacks.append(_gc_cb)
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    mem = torch.cuda.memory_stats if torch.cuda.is_available() else dict
    for i in range(args.repeats + 1):
        run = reqs if i else tp.warmup_requests(reqs)
        m0 = mem()
        c0 = compile_stats.snapshot()
        g0 = dict(_gc)
        dt = tp._run_pagedllm(llm, run)
        m1 = mem()
        c1 = compile_stats.snapshot()
        print(f"{'warm-up' if i == 0 else f'run {i}'}: {dt:.3f} s; "
              + ", ".join(f"{k} +{m1.get(k, 0) - m0.get(k, 0)}" for k in keys)
              + f"; reserved {m1.get('reserved_bytes.all.current', 0) / 2**30:.2f} GiB"
              + f"; triton compiled +{c1.compiled - c0.compiled} "
              f"({c1.compile_s - c0.compile_s:.2f} s), loaded +{c1.cache_hits - c0.cache_hits}"
              + f"; gc gen2 +{_gc['n2'] - g0['n2']} ({_gc['s'] - g0['s']:.3f} s, "
              f"max {_gc['max'] * 1e3:.0f} ms); gen0/1 +{_gc['n01'] - g0['n01']} "
              f"({_gc['s01'] - g0['s01']:.3f} s, max {_gc['max01'] * 1e3:.1f} ms)",
              flush=True)


if __name__ == "__main__":
    main()
