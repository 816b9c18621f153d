"""The MLP's first half on the GPU: cuBLAS ``gate_up_proj`` + the SiLU-and-mul kernel
against the fused ``gate_up_silu`` kernel (``kernels/gemm_silu.py``), over row counts
and launch plans.

    python benchmarks/gemm_silu_ab.py --out gemm_silu.json [--rows 128 256 384 512]

Llama-3-8B shapes (hidden 4096, intermediate 14336), bf16.  Each variant runs 8 layers
with distinct weights (1.9 GB, so every layer reads HBM as a model's layers do), captured
in one CUDA graph; the figure is the median replay time per layer.  Every fused plan is
first checked against the unfused output (max relative error over a 0.05 floor).
Prints a table and the best plan per row count (``best_plan`` in the JSON, in
``PAGEDLLM_GATE_UP_SILU_PLAN`` form).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.gemm_silu import GemmPlan, gate_up_silu

HIDDEN, INTER, LAYERS = 4096, 14336, 8
# Run 13's first sweep timed these 8 tile shapes with pointer loads and with TMA; TMA
# was as fast or faster everywhere except 256 rows, where neither beat cuBLAS.
PLANS = [GemmPlan(bm, bn, 64, st, w, True)
         for bm, bn, st, w in ((128, 128, 4, 8), (128, 128, 3, 8), (128, 64, 3, 4),
                               (64, 128, 4, 4), (64, 64, 4, 4), (64, 64, 3, 4),
                               (128, 128, 2, 8))] + [GemmPlan(128, 128, 64, 4, 8, False)]


def _graph_time(fn, replays: int = 15) -> float:
    """Median µs per layer of a CUDA graph of ``fn`` (which runs LAYERS layers)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / LAYERS)
    return statistics.median(times)


def _plan_str(p: GemmPlan) -> str:
    return ",".join(str(int(v)) for v in p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+",
                    default=[8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 1536, 2048, 4096,
                             8192],
                    help="row counts (tokens per step) to time")
    ap.add_argument("--out", default="gemm_silu.json", help="JSON results path")
    args = ap.parse_args()
    dt = torch.bfloat16
    torch.manual_seed(0)
    ws = [torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=dt) * 0.02
          for _ in range(LAYERS)]
    results: dict = {"rows": {}, "best_plan": {}}
    for m in args.rows:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=dt)
        ref = silu_and_mul(F.linear(x, ws[0]))
        base = _graph_time(lambda x=x: [silu_and_mul(F.linear(x, w)) for w in ws])
        gemm_only = _graph_time(lambda x=x: [F.linear(x, w) for w in ws])
        row = {"cublas+silu_mul": base, "cublas gate_up only": gemm_only, "plans": {}}
        for plan in PLANS:
            try:
                got = gate_up_silu(x, ws[0], plan)
                err = ((got.float() - ref.float()).abs()
                       / (ref.float().abs() + 0.05)).max().item()
                t = _graph_time(lambda p=plan, x=x: [gate_up_silu(x, w, p) for w in ws])
            except Exception as e:  # a plan that does not compile/fit: report, go on
                row["plans"][_plan_str(plan)] = {"error": repr(e)[:200]}
                print(f"M={m} plan {_plan_str(plan)}: {repr(e)[:120]}")
                continue
            row["plans"][_plan_str(plan)] = {"us": t, "max_rel_err": err}
            print(f"M={m:5d} plan {_plan_str(plan):>20}: {t:8.1f} µs/layer "
                  f"(unfused {base:.1f}, gemm alone {gemm_only:.1f}) err {err:.2e}")
        ok = {k: v for k, v in row["plans"].items()
              if "us" in v and v["max_rel_err"] < 2e-2}
        if ok:
            best = min(ok, key=lambda k: ok[k]["us"])
            results["best_plan"][str(m)] = best
            row["best"] = {"plan": best, "us": ok[best]["us"],
                           "ratio_vs_unfused": ok[best]["us"] / base}
        results["rows"][str(m)] = row
    print("\n| rows | cuBLAS gate_up | + silu_mul | fused, best plan | plan | "
          "fused / unfused |")
    print("|---:|---:|---:|---:|---|---:|")
    for m, row in results["rows"].items():
        b = row.get("best", {})
        print(f"| {m} | {row['cublas gate_up only']:.1f} | {row['cublas+silu_mul']:.1f} | "
              f"{b.get('us', float('nan')):.1f} | {b.get('plan', '-')} | "
              f"{b.get('ratio_vs_unfused', float('nan')):.3f} |")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
