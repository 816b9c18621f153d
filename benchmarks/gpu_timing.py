"""GPU timing helpers shared by the kernel benchmarks of this folder (``quant_gemm_bench``,
``moe_bench``, the ``*_sweep.py`` scripts; imported as ``gpu_timing``: run them as
``python benchmarks/NAME.py``): medians in microseconds, never asserted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def bench_us(fn: Callable[[], Any], warmup: int = 10, rep: int = 50) -> float:
    """``triton.testing.do_bench`` median of ``fn`` (launch overhead included)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep,
                                         return_mode="median")) * 1e3


def graph_us(calls: list[Callable[[], Any]], replays: int = 10) -> float:
    """Median microseconds of one call inside a CUDA graph that runs every call once --
    what a decode step sees: no launch gaps.  Pass one call per weight copy (or per
    routing) so that no call finds its data already in L2."""
    for c in calls:  # compile / warm outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]
