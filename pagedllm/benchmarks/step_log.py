"""``bench throughput --step-log FILE``: what every engine step of a timed run computed
and how long it took, summed by step kind and size.

An offline run's time is the sum of its steps', and which steps a workload makes is the
scheduler's doing (the throughput policy paces prefill over the decode horizon and fills
mixed steps up to their CUDA graph's size), so a kernel that is faster per call can still
lose end to end.  The steps come from the engine core's step trace
(``PAGEDLLM_STEP_TRACE``, ``engine/step_trace.py``: one line per step with its wall start,
scheduled tokens and requests); a step lasts until the next one starts (the run's last,
until the run ends).  A step with as many tokens as requests decodes only; any other
mixes prompt tokens in.  Sizes are bucketed as the runner pads them: decode steps by the
decode graphs' batch sizes, mixed steps by the chunk graphs' token counts (beyond the
largest: ``eager``).  Kernel time per step (under the profiler):
``benchmarks/profile_step.py --per-step``.

The JSON written holds every run's steps as ``[seconds, tokens, requests]`` and the last
run's summary rows.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from typing import Any

from pagedllm.benchmarks.workloads import inproc_runner
from pagedllm.engine.step_trace import TraceFile


class StepLog:
    """The timed runs' steps, read from the engine core's step trace.  Build it before the
    ``LLM`` (the core opens the trace file named by ``PAGEDLLM_STEP_TRACE`` at start-up:
    the caller's, else a temporary one set here); bracket each timed run with
    :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self.trace = TraceFile(prefix="step-log-")
        self.spans: list[tuple[float, float]] = []  # each timed run's wall start, end
        self._start = 0.0

    def start(self) -> None:
        self._start = time.time()

    def stop(self) -> None:
        self.spans.append((self._start, time.time()))

    def runs(self) -> list[list[tuple[float, int, int]]]:
        """Per timed run, its steps as ``(seconds, tokens, requests)``."""
        trace = self.trace.read()
        out = []
        for a, b in self.spans:
            steps = [r for r in trace if a <= r["t"] <= b]
            ends = [r["t"] for r in steps[1:]] + [b]
            out.append([(end - r["t"], r["tokens"], r["reqs"]) for r, end in zip(steps, ends)])
        return out

    def close(self) -> None:
        """Delete the trace file if this log made it."""
        self.trace.close()

    @staticmethod
    def ladders(llm: Any) -> tuple[list[int], list[int]]:
        """``(decode batch sizes, chunk token counts)`` ``llm``'s runner pads steps up to:
        its captured graphs' where it has them, else the nominal ladders."""
        from pagedllm.worker.cuda_graphs import CHUNK_SIZES, capture_sizes

        graphs = getattr(inproc_runner(llm), "graphs", None)
        if graphs is not None:
            return sorted(graphs.sizes), sorted(graphs.chunk_sizes)
        return capture_sizes(llm.llm_engine.config.scheduler_config.max_num_seqs), \
            list(CHUNK_SIZES)

    @staticmethod
    def replay_ms(llm: Any) -> dict[tuple[str, int], float]:
        """``(kind, size) -> ms`` of the captured graphs' replays, timed at capture
        (context ~0: the step's model alone), where ``llm``'s runner has graphs."""
        graphs = getattr(inproc_runner(llm), "graphs", None)
        if graphs is None:
            return {}
        return {("decode" if s.decode else "mixed", s.reqs if s.decode else s.tokens): ms
                for s, ms in graphs.replay_ms.items()}


def summarise(steps: list[tuple[float, int, int]], decode_sizes: list[int],
              chunk_sizes: list[int], replay_ms: dict[tuple[str, int], float] | None = None
              ) -> list[dict[str, Any]]:
    """One row per (kind, bucket) with the steps' count, total and median seconds, share
    of the run, mean tokens and requests, and the bucket's graph replay time where
    ``replay_ms`` has it; decode rows first, by size."""
    groups: dict[tuple[str, int], list[tuple[float, int, int]]] = {}
    for s in steps:
        dt, tokens, reqs = s
        kind, n, ladder = (("decode", reqs, decode_sizes) if tokens == reqs
                           else ("mixed", tokens, chunk_sizes))
        i = bisect.bisect_left(ladder, n)
        groups.setdefault((kind, ladder[i] if i < len(ladder) else 0), []).append(s)
    total = sum(s[0] for s in steps) or 1.0
    rows = []
    for (kind, size), g in sorted(groups.items(), key=lambda e: (e[0][0], e[0][1] or 1 << 30)):
        secs = sum(s[0] for s in g)
        rows.append({"kind": kind, "size": size or "eager", "steps": len(g),
                     "seconds": secs, "share": secs / total,
                     "median_ms": 1e3 * statistics.median(s[0] for s in g),
                     "mean_tokens": sum(s[1] for s in g) / len(g),
                     "mean_reqs": sum(s[2] for s in g) / len(g),
                     "replay_ms": (replay_ms or {}).get((kind, size))})
    return rows


def print_summary(rows: list[dict[str, Any]]) -> None:
    """The table ``bench throughput --step-log`` prints (``graph ms``: the bucket's graph
    replay at capture, ``-`` without one)."""
    print(f"{'step':<7}{'<= size':>8}{'steps':>7}{'seconds':>9}{'share':>7}"
          f"{'median ms':>11}{'graph ms':>10}{'tokens':>8}{'requests':>9}")
    for r in rows:
        graph = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.2f}"
        print(f"{r['kind']:<7}{r['size']:>8}{r['steps']:>7}{r['seconds']:>9.3f}"
              f"{r['share']:>7.1%}{r['median_ms']:>11.2f}{graph:>10}"
              f"{r['mean_tokens']:>8.1f}{r['mean_reqs']:>9.1f}")


def write(path: str, runs: list[list[tuple[float, int, int]]],
          rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"runs": runs, "summary": rows}, f)
