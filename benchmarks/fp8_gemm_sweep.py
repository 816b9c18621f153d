"""Sweep the Triton FP8 GEMM (``kernels/fp8_gemm.py``) against cuBLASLt's row-wise
``torch._scaled_mm`` at decode-sized M and write the routing table.

Usage (on the GPU)::

    python benchmarks/fp8_gemm_sweep.py --shapes llama3-8b --table fp8_gemm_<GPU>.json

For each ``(n, k)`` weight of the shapes and each M, every candidate launch configuration
is checked against the fp32 product of the same e4m3 operands (relative error below
``--tol``) and timed by CUDA-graph replay over enough weight copies to stream from HBM
(weights of 16 MB would otherwise sit in the 50 MB L2).  The table routes an M to the
fastest checked configuration where it beats cuBLASLt by ``--min-gain`` or more, else to
cuBLASLt.  The printout also has each M's per-layer totals (the four projections).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
from gpu_timing import graph_us

from pagedllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm

SHAPES = {
    # (n, k) of qkv_proj, o_proj, gate_up_proj, down_proj
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama3-70b-tp2": [(5120, 8192), (4096, 8192), (28672, 8192), (8192, 14336)],
}
F8 = torch.float8_e4m3fn


def cublas_calls(x_q, x_scale, ws, w_scale) -> list:
    """cuBLASLt's row-wise FP8 GEMM, one call per weight copy."""
    return [functools.partial(torch._scaled_mm, x_q, w.t(), scale_a=x_scale,
                              scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
            for w in ws]


def triton_calls(x_q, x_scale, ws, w_scale, cfg) -> list:
    """The Triton FP8 GEMM with ``cfg``, one call per weight copy."""
    return [functools.partial(fp8_gemm, x_q, x_scale, w, w_scale, None, torch.bfloat16,
                              cfg) for w in ws]


def candidates(m: int, n: int, k: int, sms: int) -> list[Fp8GemmConfig]:
    """Launch configurations worth timing at ``m`` rows: the rows as wgmma's N dimension
    (swap) at every M, the plain layout from 64 rows; 64- and 128-wide weight tiles;
    split-K to one and to two waves of programs; above 64 rows (where the 2026-12-03
    sweep found cuBLASLt level with these) also 3 or 5 stages and 8 warps."""
    bm0 = min(128, max(16, triton.next_power_of_2(m)))
    out: list[Fp8GemmConfig] = []
    for swap in ((1,) if m <= 64 else (1, 0)):
        bms = {bm0} if swap else {max(64, bm0)}
        if swap and m > 64:
            bms.add(bm0 // 2)
        for bm in sorted(bms):
            for bn in (64, 128):
                bk = 128
                warps = 8 if (not swap and bm * bn >= 128 * 128) else 4
                programs = -(-m // bm) * -(-n // bn)
                splits = sorted({max(1, min(16, k // bk, round(w * sms / programs)))
                                 for w in (1, 2)})
                for split in splits:
                    out.append((bm, bn, bk, warps, 4, split, swap))
                if m > 64 and swap:  # with the one-wave split only
                    out += [(bm, bn, bk, w, st, splits[0], swap)
                            for w, st in ((4, 3), (4, 5), (8, 4))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b", choices=sorted(SHAPES),
                    help="which model's projection shapes to sweep")
    ap.add_argument("--ms", default="2,4,8,16,32,48,64,96,128,192,256",
                    help="comma-separated row counts; an entry serves every M up to it")
    ap.add_argument("--table", default=None, help="write the routing table here (JSON)")
    ap.add_argument("--tol", type=float, default=1e-2,
                    help="largest relative error (max |err| / max |ref|) a config may have")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="route to Triton only where it is at least this much faster")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm_sweep: needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ms = [int(v) for v in a.ms.split(",")]
    table: list[list] = []
    totals: dict[int, list[float]] = {m: [0.0, 0.0] for m in ms}
    for n, k in SHAPES[a.shapes]:
        copies = max(2, int(400e6 // (n * k)))
        ws = [(torch.randn(n, k, device=dev) * 0.02).to(F8) for _ in range(copies)]
        w_scale = torch.rand(n, device=dev) + 0.5
        for m in ms:
            x_q = torch.randn(m, k, device=dev).clamp(-448, 448).to(F8)
            x_scale = torch.rand(m, 1, device=dev) + 0.5
            ref = (x_q.float() @ ws[0].float().t()) * x_scale * w_scale
            scale = float(ref.abs().max())
            base = graph_us(cublas_calls(x_q, x_scale, ws, w_scale))
            best: tuple[float, Fp8GemmConfig | None] = (base, None)
            for cfg in candidates(m, n, k, sms):
                try:
                    got = fp8_gemm(x_q, x_scale, ws[0], w_scale, None, torch.bfloat16, cfg)
                    err = float((got.float() - ref).abs().max()) / scale
                    if not err <= a.tol:
                        print(f"  {cfg}: error {err:.2e}, skipped", flush=True)
                        continue
                    us = graph_us(triton_calls(x_q, x_scale, ws, w_scale, cfg))
                except Exception as e:  # a config the compiler refuses: not a candidate
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if us < best[0]:
                    best = (us, cfg)
            use = best[1] is not None and best[0] <= base * (1 - a.min_gain)
            totals[m][0] += base
            totals[m][1] += best[0] if use else base
            table.append([m, n, k, "triton" if use else "cublas",
                          list(best[1]) if use and best[1] else None])
            print(f"n={n} k={k} m={m}: cuBLASLt {base:.1f} us, best Triton "
                  f"{best[0]:.1f} us {best[1]} -> {'triton' if use else 'cublas'}",
                  flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    for m in ms:
        print(f"m={m}: four projections cuBLASLt {totals[m][0]:.1f} us, routed "
              f"{totals[m][1]:.1f} us ({totals[m][0] / totals[m][1]:.2f}x)")
    if a.table:
        with open(a.table, "w") as f:
            json.dump({"configs": table, "summary": {
                "device": torch.cuda.get_device_name(), "shapes": a.shapes,
                "per_layer_us": {str(m): [round(v, 1) for v in t]
                                 for m, t in totals.items()}}}, f, indent=1)


if __name__ == "__main__":
    main()
