"""Dense-layer timings on the GPU: cuBLAS against the row count, and the skinny decode
kernel (``kernels/gemv.py``) against cuBLAS.

    python benchmarks/gemm_sweep.py --out sweep.json

Part 1 times one Llama-3-8B decoder layer's four projections (qkv, o, gate_up, down) with
cuBLAS at M = 1 .. 8192 rows: how a step's GEMM time grows with its token count (the
weight-read floor at small M, the FLOP rate at large M).  Part 2 times each projection of
Llama-3-8B and SmolLM2-135M at batch 1 with cuBLAS and with ``gemv`` (plus a grid of
``gemv`` launch configurations), replayed from CUDA graphs as the decode step runs them,
and checks their outputs agree.

Weights rotate over several copies (> 50 MB L2 in total) so every launch reads HBM, as a
model's layers do.  Times are medians of CUDA-event timings.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pagedllm.kernels.gemv import gemv

LLAMA = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336)}
SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn, iters: int = 50) -> float:
    """Median µs of ``fn()`` (which launches work on the current stream)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / iters)
    return statistics.median(times)


def _copies(n: int, k: int, dt: torch.dtype) -> list[torch.Tensor]:
    count = max(2, -(-200_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(count)]


def layer_sweep(ms: list[int]) -> list[dict]:
    dt = torch.bfloat16
    ws = {name: _copies(n, k, dt) for name, (n, k) in LLAMA.items()}
    flops_per_row = sum(2 * n * k for n, k in LLAMA.values())
    rows = []
    for m in ms:
        xs = {name: torch.randn(m, k, device="cuda", dtype=dt) for name, (_, k) in
              LLAMA.items()}
        it = [0]

        def step(it=it, xs=xs) -> None:
            i = it[0]
            it[0] += 1
            for name in LLAMA:
                w = ws[name][i % len(ws[name])]
                torch.nn.functional.linear(xs[name], w)

        us = _time(step)
        rows.append({"m": m, "layer_us": us, "tflops": flops_per_row * m / us / 1e6,
                     "model_ms": us * 32 / 1000})
        print(f"cuBLAS layer  M={m:5d}  {us:8.1f} µs/layer  {rows[-1]['tflops']:6.1f} TFLOP/s"
              f"  x32 = {rows[-1]['model_ms']:.2f} ms", flush=True)
    return rows


def _graph_time(launch, copies: int, reps: int = 5) -> float:
    """Median µs per call of ``launch(i)`` (i = weight copy), timed by replaying a CUDA
    graph of ``4 * copies`` calls: no Python or launch overhead, as in decode graphs."""
    for i in range(copies):
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    calls = 4 * copies
    with torch.cuda.graph(g):
        for i in range(calls):
            launch(i % copies)
    g.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / calls)
    return statistics.median(times)


GRID = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512) for w in (2, 4, 8)]


def gemv_vs_cublas() -> list[dict]:
    """Batch-1 decode: cuBLAS against the GEMV (default config and a grid), graph-timed.
    For ``down`` also SiLU-and-mul + cuBLAS against the GEMV with the activation fused."""
    from pagedllm.kernels.activation import silu_and_mul

    dt = torch.bfloat16
    rows = []
    for model, shapes in (("llama3-8b", LLAMA), ("smollm2-135m", SMOL)):
        for name, (n, k) in shapes.items():
            ws = _copies(n, k, dt)
            x = torch.randn(1, k, device="cuda", dtype=dt)
            out = torch.empty(1, n, device="cuda", dtype=dt)
            diff = (gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            t_c = _graph_time(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws))
            t_g = _graph_time(lambda i, x=x, ws=ws, out=out: gemv(x, ws[i], out=out),
                              len(ws))
            gb = n * k * 2 / 1e9
            row = {"model": model, "layer": name, "n": n, "k": k, "cublas_us": t_c,
                   "gemv_us": t_g, "cublas_tbs": gb / t_c * 1e3, "gemv_tbs": gb / t_g * 1e3,
                   "max_abs_diff": diff}
            if model == "llama3-8b":
                grid = {}
                for cfg in GRID:
                    grid[f"bn{cfg[0]}_bk{cfg[1]}_w{cfg[2]}"] = _graph_time(
                        lambda i, x=x, ws=ws, out=out, cfg=cfg: gemv(x, ws[i], out=out,
                                                                    config=cfg), len(ws))
                row["grid_best"] = sorted(grid.items(), key=lambda kv: kv[1])[:4]
            if name == "down":
                gu = torch.randn(1, 2 * k, device="cuda", dtype=dt)
                row["silu_cublas_us"] = _graph_time(
                    lambda i, gu=gu, ws=ws: F.linear(silu_and_mul(gu), ws[i]), len(ws))
                row["silu_gemv_us"] = _graph_time(
                    lambda i, gu=gu, ws=ws, out=out: gemv(gu, ws[i], out=out,
                                                          silu_mul=True), len(ws))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def blas_variants(ms: list[int]) -> dict[str, list[dict]]:
    """The layer sweep under three GEMM back ends: torch's default (cuBLAS), cuBLASLt
    (``preferred_blas_library``), and TunableOp, which times cuBLAS against cuBLASLt's
    heuristic algorithms per shape and keeps the fastest (tuned on first use)."""
    res = {"cublas": layer_sweep(ms)}
    torch.backends.cuda.preferred_blas_library("cublaslt")
    res["cublaslt"] = layer_sweep(ms)
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_max_tuning_duration(200)
    res["tunable"] = layer_sweep(ms)
    torch.cuda.tunable.enable(False)
    for i, m in enumerate(ms):
        print(f"M={m:5d}  " + "  ".join(f"{k} {v[i]['model_ms']:.2f} ms"
                                        for k, v in res.items()), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--skip-layer-sweep", action="store_true")
    ap.add_argument("--blas", action="store_true",
                    help="only compare cuBLAS, cuBLASLt and TunableOp-tuned GEMMs on the "
                    "layer sweep at W1's step sizes, then exit")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row counts: run only the layer sweep at these")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name()}
    if a.rows:
        res["layer_sweep"] = layer_sweep([int(m) for m in a.rows.split(",")])
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if a.blas:
        res["blas"] = blas_variants([64, 128, 192, 256, 384, 512, 1024, 4096, 8192])
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if not a.skip_layer_sweep:
        res["layer_sweep"] = layer_sweep([1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384,
                                          448, 512, 640, 768, 1024, 1536, 2048, 4096,
                                          8192])
    res["gemv"] = gemv_vs_cublas()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
