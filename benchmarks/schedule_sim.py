"""Replay W1 through the real scheduler (no model) and price each step with a cost model
fitted to the H200 measurements of run 9 (docs/findings.md), to compare scheduling
policies before spending device time.

Usage: python benchmarks/schedule_sim.py [--policy fcfs throughput ...] [--steps FILE]
       [--workload W1 W5 uniform bimodal small many long-prompt long-output]

``--workload``: W1 (default) and W5 as BENCHMARKS.md draws them, and batches of other
shapes, all of known length (``ignore_eos``: the throughput policy plans only with such
requests; others run as under FCFS whatever the policy) -- to check a policy on more
than the two workloads a device run measures.

The scheduler runs as the engine drives it (async scheduling, 8,192-token budget,
max_num_seqs 256, prefix caching on); a null runner "samples" a token whenever a
request's prompt is computed.  Each step's price (ms, Llama-3-8B shape, bf16, one H200):

* GEMMs: ``gemm_sweep.py --blas``'s cuBLAS time at the step's token count (linear
  between the measured row counts), plus lm_head on the sampled rows;
* decode attention: the step's KV bytes over the bandwidth run 9 measured at that batch;
* prompt attention: query x key pairs at the rate of W1's mixed steps;
* the rest (norms, SiLU, rotary, sampling) and the idle gap per step, as profiled.

It is a model: it reproduces run 9's FCFS profile (8.38 s) and says where a policy's
time would go; only a device run says what it does.
"""

from __future__ import annotations

import argparse
import bisect
import json

from scheduler_cost import _NullRunner  # benchmarks/, on sys.path when run as a script

from pagedllm.benchmarks.workloads import BenchRequest, w1, w5
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import capture_sizes, chunk_capture_sizes

# gemm_sweep.py --blas, cuBLAS, one layer's four projections x 32 layers (ms), run 9.
_GEMM_M = [1, 16, 64, 128, 192, 256, 384, 512, 1024, 4096, 8192]
_GEMM_MS = [3.95, 4.01, 4.24, 4.51, 5.31, 5.89, 8.34, 10.91, 21.50, 86.17, 167.25]
_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x dim x bf16
# Decode attention bandwidth (TB/s) by decode batch, run 9's per-step profile.
_ATT_BW = [(193, 3.60), (129, 3.54), (65, 3.28), (33, 3.08), (9, 1.97), (1, 1.2)]
_PREFILL_NS_PER_PAIR = 0.25e9 / 50.8e6 / 1e3  # 0.25 s over W1's 50.8M causal pairs, in ns


def gemm_ms(m: int, sampled: int) -> float:
    i = bisect.bisect_left(_GEMM_M, m)
    if i == 0:
        base = _GEMM_MS[0]
    elif i >= len(_GEMM_M):
        base = _GEMM_MS[-1] * m / _GEMM_M[-1]
    else:
        m0, m1 = _GEMM_M[i - 1], _GEMM_M[i]
        base = _GEMM_MS[i - 1] + (_GEMM_MS[i] - _GEMM_MS[i - 1]) * (m - m0) / (m1 - m0)
    lm_head = max(0.24, sampled * 2 * 4096 * 128256 / 650e12 * 1e3)
    return base + lm_head


def decode_att_ms(batch: int, ctx_tokens: int) -> float:
    if batch == 0:
        return 0.0
    bw = next(b for lo, b in _ATT_BW if batch >= lo)
    return ctx_tokens * _KV_BYTES_PER_TOKEN / (bw * 1e12) * 1e3


# Batches of known length besides W1 and W5 (name: W1's generator's arguments).
_SHAPES: dict[str, dict] = {
    "uniform": dict(num_requests=256, olen_range=(256, 256)),  # equal lengths: FCFS
    "bimodal": dict(num_requests=256, seed=1, olen_range=(32, 1024)),
    "small": dict(num_requests=16, seed=2),
    "many": dict(num_requests=1024, seed=3),  # 4x max_num_seqs
    "long-prompt": dict(num_requests=256, seed=4, plen_range=(1024, 4096),
                        olen_range=(8, 64)),
    "long-output": dict(num_requests=256, seed=5, plen_range=(16, 64),
                        olen_range=(256, 1024)),
}
WORKLOADS = ["W1", "W5", *_SHAPES]


def workload(name: str, num_prompts: int = 256) -> list[BenchRequest]:
    if name == "W1":
        return w1(num_prompts)
    if name == "W5":
        return w5()
    if name == "bimodal":  # each output either short or long
        reqs = w1(**_SHAPES[name])
        for r in reqs:
            r.output_len = 32 if r.output_len < 528 else 1024
        return reqs
    return w1(**_SHAPES[name])


def simulate(policy: str, budget: int = 8192, num_prompts: int = 256,
             fill: bool = True, batches: bool = False,
             num_blocks: int = 256 * 2048 // 16 + 1,
             reqs: list[BenchRequest] | None = None) -> list[dict]:
    """W1's (or ``reqs``') steps under ``policy``; ``fill``: the scheduler knows the
    chunk-graph sizes (as the engine tells it with CUDA graphs on).  ``batches``: each
    step also lists its requests as ``[query_len, seq_len]`` pairs in the scheduler's
    order (what attention sees).  ``num_blocks``
    must hold every running request whole (the null runner cannot recompute)."""
    reqs = w1(num_prompts) if reqs is None else reqs
    max_len = 8192
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget,
                                  max_model_len=max_len, async_scheduling=True,
                                  policy=policy),  # type: ignore[arg-type]
                  CacheConfig(block_size=16, enable_prefix_caching=True),
                  num_blocks=num_blocks,
                  fill_step_sizes=chunk_capture_sizes(budget, max_len) if fill else ())
    for i, r in enumerate(reqs):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
        s.add_request(Request(str(i), r.prompt_token_ids, sp, eos_token_id=2))
    runner = _NullRunner()
    inflight = None
    steps: list[dict] = []
    while s.has_unfinished_requests():
        so = s.schedule()
        reqs_by_id = s.requests
        dec = ctx = pairs = pre = 0
        batch = []
        for rid, n in so.num_scheduled_tokens.items():
            r = reqs_by_id[rid]
            end = r.num_computed_tokens  # already advanced by schedule()
            batch.append([n, end])
            if n == 1 and end > r.num_prompt_tokens:
                dec += 1
                ctx += end
            else:
                pre += n
                start = end - n
                pairs += n * start + n * (n + 1) // 2
        mo = runner.execute(so)
        sampled = sum(1 for t in mo.sampled_token_ids if t)
        tokens = so.total_num_scheduled_tokens
        if tokens:
            steps.append(dict(tokens=tokens, decodes=dec, prefill=pre, ctx=ctx, pairs=pairs,
                              sampled=sampled))
            if batches:
                steps[-1]["batch"] = batch
        prev, inflight = inflight, (so, mo)
        if prev is not None:
            s.update_from_output(*prev)
        if not s.has_unfinished_requests() and inflight is not None:
            s.update_from_output(*inflight)
            inflight = None
    return steps


_DECODE_SIZES = capture_sizes(256)
_CHUNK_SIZES = chunk_capture_sizes(8192, 8192)


def padded(st: dict) -> int:
    """Rows the step's GEMMs run on: its CUDA graph's size (eager beyond the largest)."""
    t = st["tokens"]
    sizes = _DECODE_SIZES if st["prefill"] == 0 else _CHUNK_SIZES
    return next((s for s in sizes if s >= t), t)


def price(st: dict) -> dict[str, float]:
    rows = padded(st)
    g = gemm_ms(rows, st["sampled"])
    a = decode_att_ms(st["decodes"], st["ctx"]) + st["pairs"] * _PREFILL_NS_PER_PAIR * 1e-6
    other = 0.3 + 1.3e-3 * rows
    return dict(gemm=g, attention=a, other=other, idle=0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", nargs="+", default=["fcfs", "throughput"])
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--steps", help="write each policy's steps (JSON lines) here")
    ap.add_argument("--no-fill", action="store_true",
                    help="the scheduler does not know the chunk-graph sizes")
    ap.add_argument("--workload", nargs="+", default=["W1"], choices=WORKLOADS)
    ap.add_argument("--num-blocks", type=int, default=53_000,
                    help="KV blocks of 16 tokens (default: about the H200's for the "
                         "Llama-3-8B shape in bf16 at 0.9 memory use)")
    a = ap.parse_args()
    print(f"{'workload':>12}{'policy':>12}{'steps':>7}{'GEMM s':>8}{'attn s':>8}"
          f"{'other s':>8}{'idle s':>8}{'total s':>9}{'out tok/s':>10}{'vs first':>9}"
          f"{'min M':>7}{'median M':>9}")
    for name in a.workload:
        reqs = workload(name)
        out_tokens = sum(r.output_len for r in reqs)
        first = None
        for pol in a.policy:
            steps = simulate(pol, a.budget, fill=not a.no_fill, num_blocks=a.num_blocks,
                             reqs=reqs)
            parts = {k: 0.0 for k in ("gemm", "attention", "other", "idle")}
            for st in steps:
                for k, v in price(st).items():
                    parts[k] += v / 1e3
            total = sum(parts.values())
            first = first or total
            ms = sorted(st["tokens"] for st in steps)
            print(f"{name:>12}{pol:>12}{len(steps):>7}{parts['gemm']:>8.2f}"
                  f"{parts['attention']:>8.2f}{parts['other']:>8.2f}{parts['idle']:>8.2f}"
                  f"{total:>9.2f}{out_tokens / total:>10,.0f}{first / total:>8.3f}x"
                  f"{ms[0]:>7}{ms[len(ms) // 2]:>9}")
            if a.steps:
                with open(f"{a.steps}.{name}.{pol}.jsonl", "w") as f:
                    for st in steps:
                        f.write(json.dumps(st) + "\n")


if __name__ == "__main__":
    main()
