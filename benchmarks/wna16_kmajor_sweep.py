"""Small-M W4A16 kernels on the K-major layout (``kernels/wna16_kmajor.py``) on the GPU:
every GEMV configuration of a small grid checked (fp32 reference, twice for the same
bits) in worker processes, then timed under CUDA-graph replay against the striped GEMV
(its configuration for this GPU, and the shipped H200 table's) and the tensor-core GEMM
of ``kernels/wna16_tc.py`` (the H200 table's M = 16 entry; the K-major layout's other
small-M candidate from 4 rows), at the Llama-3-8B projections, M = 1, 2, 4, 8; the
dequantise kernel checked bit for bit and timed against ``stripe_dequantize``, then the
dequantise + cuBLAS route (``int_cuda.kmajor_dequant_linear``, whole layers) at 256 and
1,024 rows against bf16 ``F.linear``: the numbers that decide where the tensor-core
table's ``dequant`` entries should stand for this layout.  One device call (< 8 min):

    python benchmarks/wna16_kmajor_sweep.py --out $OUT/wna16_kmajor_sweep.json \
        --table $OUT/wna16_kmajor_configs.json

``--table`` writes each shape's fastest checked configuration in the format of
``PAGEDLLM_WNA16_KMAJOR_CONFIGS`` (``kernels/wna16_kmajor.tuned_table``): point the
engine at it for an end-to-end A/B, and ship it as
``pagedllm/kernels/tuned/wna16_kmajor_<GPU name>.json`` once that wins.

Weights as the layers store them: bf16 scales, explicit fp32 zero points (the layers'
contract: symmetric weights get zero 8).  Timing: one call per weight copy (> 256 MB of
copies: every call reads HBM), median of 10 graph replays (``gpu_timing.graph_us``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from functools import partial
from typing import Any

import torch
from gpu_timing import bench_us, graph_us
from wna16_tc_sweep import _weights as tc_weights

ROWS = (1, 2, 4, 8)
PROJ = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336)}
GROUP = 128
TOL = 2 ** -7  # bf16 output rounding plus accumulation order
# (block_n, block_k, warps) per block_m, each with split-K 1, auto and double, and the
# register prefetch off and on
GRID = {1: [(128, 128, 4), (128, 64, 4), (64, 128, 2), (256, 64, 8), (64, 256, 4),
            (32, 512, 4)],
        4: [(128, 64, 4), (128, 32, 4), (64, 64, 2), (128, 128, 8), (64, 128, 4)],
        8: [(64, 64, 4), (64, 32, 2), (128, 32, 4), (128, 64, 8), (32, 64, 2)]}
GRID[2] = GRID[1]
DEQUANT = [(64, 128, 4), (32, 128, 4), (128, 128, 4), (128, 64, 4), (256, 64, 8),
           (64, 64, 2)]  # block_k divides the group
COPY_BYTES = 256 << 20
DEV = "cuda"  # a CPU smoke test under TRITON_INTERPRET sets "cpu"


def _weights(n: int, k: int, dev: torch.device, seed: int = 0):
    """The tensor-core sweep's random group-128 weight (same codes, scales and zeros) in
    every layout, by name."""
    qw, st, qt, sc, sct, zt, zp = tc_weights(n, k, dev, seed)
    return {"qw": qw, "st": st, "sc": sc, "zp": zp, "qt": qt, "sct": sct, "zt": zt}


def gemv_configs(m: int, n: int, k: int, dev: torch.device) -> list[tuple[int, ...]]:
    """The prior first, then the grid (``GRID``)."""
    from pagedllm.kernels.wna16_kmajor import auto_split, kmajor_config

    prior = kmajor_config(m, n, k, dev)
    bm = prior[0]
    out = [prior]
    for bn, bk, warps in GRID[bm]:
        s0 = auto_split(n, k, bn, bk, dev)
        for split in sorted({1, s0, min(2 * s0, 16, k // bk)}):
            for ahead in (0, 1):
                cfg = (bm, bn, bk, split, warps, 1, ahead)
                if cfg not in out:
                    out.append(cfg)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _check(jobs: list[tuple[int, str, int, tuple[int, ...]]]) -> list[dict[str, Any]]:
    """Worker: compile and check each job (an exception -- maybe a sticky CUDA error --
    fails that job and is reported)."""
    from pagedllm.kernels.wna16 import wna16_ref
    from pagedllm.kernels.wna16_kmajor import kmajor_gemv

    dev = torch.device(DEV)
    cache: dict[str, Any] = {}
    res = []
    for i, name, m, cfg in jobs:
        rec: dict[str, Any] = {"i": i}
        try:
            if name not in cache:
                cache[name] = _weights(*PROJ[name], dev, seed=1)
            w = cache[name]
            x = torch.randn(m, PROJ[name][1], device=dev, dtype=torch.bfloat16)
            ref = wna16_ref(x.float(), w["qw"], w["sc"], w["zp"], None, 4, GROUP)
            got = kmajor_gemv(x, w["qt"], w["sct"], w["zt"], GROUP, config=cfg)
            again = kmajor_gemv(x, w["qt"], w["sct"], w["zt"], GROUP, config=cfg)
            if got.is_cuda:
                torch.cuda.synchronize()
            rec.update(err=_rel(got, ref), same_bits=bool(torch.equal(got, again)))
            rec["ok"] = rec["err"] < TOL and rec["same_bits"]
        except Exception as e:  # noqa: BLE001  (reported)
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        res.append(rec)
    return res


def _h200_table(name: str, m: int, n: int, k: int) -> tuple[int, ...] | None:
    """The shipped H200 table's configuration (``wna16``: striped, ``wna16_tc``: the
    tensor-core GEMM) for the smallest swept ``m' >= m`` at ``(n, k)``."""
    path = os.path.join(os.path.dirname(__file__), "..", "pagedllm", "kernels", "tuned",
                        f"{name}_NVIDIA_H200.json")
    if not os.path.exists(path):
        return None
    from pagedllm.kernels.tuned_tables import smallest_fit

    with open(path) as fh:
        table = {(e[0], e[1], e[2]): e[-1] for e in json.load(fh)["configs"]}
    cfg = smallest_fit(table, m, n, k)
    return None if cfg is None else tuple(cfg)


def time_gemv(name: str, m: int, copies: list[dict], jobs: list, checked: dict,
              deadline: float) -> dict[str, Any]:
    """The striped baselines and every checked K-major configuration at ``(name, m)``."""
    from pagedllm.kernels.wna16 import wna16_ref
    from pagedllm.kernels.wna16_kmajor import kmajor_gemv
    from pagedllm.kernels.wna16_stripe import stripe_config, stripe_gemm
    from pagedllm.kernels.wna16_tc import w4a16_tc_gemm

    n, k = PROJ[name]
    dev = torch.device(DEV)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    row: dict[str, Any] = {"proj": name, "m": m}
    c0 = copies[0]
    ref = wna16_ref(x.float(), c0["qw"], c0["sc"], c0["zp"], None, 4, GROUP)
    for label, cfg in (("stripe", stripe_config(m, n, k, dev)),
                       ("stripe_h200_table", _h200_table("wna16", m, n, k)),
                       ("tc16_h200_table", _h200_table("wna16_tc", 16, n, k))):
        if cfg is None or cfg[0] < m:
            continue
        if label.startswith("tc"):  # the tensor-core GEMM, rows padded to its 16
            fn = partial(w4a16_tc_gemm, x, config=cfg)
            calls = [partial(fn, c["qt"], c["sct"], c["zt"], GROUP) for c in copies]
        else:
            calls = [partial(stripe_gemm, x, c["st"], c["sc"], c["zp"], 4, GROUP,
                             config=cfg) for c in copies]
        row[label] = cfg
        row[f"{label}_err"] = _rel(calls[0](), ref)
        row[f"{label}_us"] = graph_us(calls)
    times = []
    prior = gemv_configs(m, n, k, dev)[0]
    for i, (jn, jm, cfg) in enumerate(jobs):
        if (jn, jm) != (name, m) or not checked[i]["ok"] or time.time() > deadline:
            continue
        times.append((graph_us([partial(kmajor_gemv, x, c["qt"], c["sct"], c["zt"], GROUP,
                                         config=cfg) for c in copies]), cfg))
    by_cfg = {cfg: us for us, cfg in times}
    best = min(times) if times else (None, None)
    row.update(kmajor_prior=prior, kmajor_prior_us=by_cfg.get(prior), kmajor_best=best[1],
               kmajor_best_us=best[0], all=sorted(times)[:8])
    return row


def time_dequant(name: str, w: dict) -> dict[str, Any]:
    """The dequantise kernel: bit for bit the reference, then timed against the striped
    one (``do_bench``: the bf16 output is larger than L2 or nearly)."""
    from pagedllm.kernels.wna16 import dequantize
    from pagedllm.kernels.wna16_kmajor import kmajor_dequantize
    from pagedllm.kernels.wna16_stripe import stripe_dequantize

    n, k = PROJ[name]
    out = torch.empty(n, k, device=DEV, dtype=torch.bfloat16)
    ref = dequantize(w["qw"], w["sc"], w["zp"], None, 4, GROUP).to(torch.bfloat16)
    res: dict[str, Any] = {"proj": name, "stripe_us": bench_us(
        partial(stripe_dequantize, w["st"], w["sc"], w["zp"], 4, GROUP, out))}
    for cfg in DEQUANT:
        out.fill_(float("nan"))
        kmajor_dequantize(w["qt"], w["sct"], w["zt"], GROUP, out, config=cfg)
        exact = bool(torch.equal(out, ref))
        res[str(cfg)] = (exact, bench_us(partial(
            kmajor_dequantize, w["qt"], w["sct"], w["zt"], GROUP, out, config=cfg))
            if exact else None)
    return res


DEQUANT_ROWS = (256, 1024)  # prompt-chunk and W1-decode-sized row counts


def time_dequant_mm(name: str, copies: list[dict]) -> list[dict[str, Any]]:
    """The dequantise + cuBLAS route as the layers run it (``int_cuda.
    kmajor_dequant_linear``: the whole layer) against bf16 ``F.linear`` at
    ``DEQUANT_ROWS`` (graph-timed, one call per weight copy)."""
    import torch.nn.functional as F

    from pagedllm.kernels.wna16 import dequantize
    from pagedllm.layers.quantization.int_cuda import kmajor_dequant_linear

    n, k = PROJ[name]
    scratch = torch.empty(n * k, device=DEV, dtype=torch.bfloat16)
    dense = dequantize(copies[0]["qw"], copies[0]["sc"], copies[0]["zp"], None, 4,
                       GROUP).to(torch.bfloat16)
    dcopies = [dense] + [dense.clone() for _ in range(max(0, COPY_BYTES // (2 * n * k)))]
    out = []
    for m in DEQUANT_ROWS:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        row: dict[str, Any] = {"proj": name, "m": m, "bf16_us": graph_us(
            [partial(F.linear, x, w) for w in dcopies])}
        row["whole_us"] = graph_us([partial(kmajor_dequant_linear, x, c["qt"], c["sct"],
                                            c["zt"], GROUP, scratch) for c in copies])
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--table", default=None,
                    help="write PAGEDLLM_WNA16_KMAJOR_CONFIGS JSON here")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    jobs = [(name, m, cfg) for name, (n, k) in PROJ.items() for m in ROWS
            for cfg in gemv_configs(m, n, k, dev)]
    indexed = [(i, *j) for i, j in enumerate(jobs)]
    parts = [indexed[i::args.procs] for i in range(args.procs)]
    with mp.get_context("spawn").Pool(args.procs) as pool:
        checked = {r["i"]: r for part in pool.map(_check, parts) for r in part}
    print(f"checked {len(jobs)} configurations in {time.time() - t0:.0f} s; failed: "
          f"{[(jobs[i], r) for i, r in checked.items() if not r['ok']]}", flush=True)

    rows: list[dict[str, Any]] = []
    for name, (n, k) in PROJ.items():
        copies = [_weights(n, k, dev, seed=s)
                  for s in range(max(1, COPY_BYTES // (n * k // 2)))]
        for m in ROWS:
            rows.append(time_gemv(name, m, copies, jobs, checked, t0 + args.budget_s))
            print(json.dumps({kk: v for kk, v in rows[-1].items() if kk != "all"}),
                  flush=True)
        rows.append({"dequant": time_dequant(name, copies[0])})
        print(json.dumps(rows[-1]), flush=True)
        for r in time_dequant_mm(name, copies):
            rows.append({"dequant_mm": r})
            print(json.dumps(rows[-1]), flush=True)
        del copies
        torch.cuda.empty_cache()

    totals = step_totals(rows)
    print("per-step ms (32 layers):", json.dumps(totals), flush=True)
    mm_totals = dequant_mm_totals(rows)
    print("dequantise + cuBLAS, per-step ms (32 layers):", json.dumps(mm_totals), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                   "per_step_ms_x32_layers": totals,
                   "dequant_mm_per_step_ms_x32_layers": mm_totals,
                   "checks": {str(jobs[i]): r for i, r in checked.items()}}, fh, indent=1)
    if args.table:
        with open(args.table, "w") as fh:
            json.dump(table_of(rows), fh, indent=1)


def _per_step(at_m: list[dict[str, Any]], keys: Any) -> dict[str, float]:
    """Each of ``keys`` summed over one row count's projections, as ms a decode step (32
    layers): only where every projection has a row and timed it -- a sweep whose budget
    ran out before the last projections (or a variant that failed its check) is left out
    rather than summing fewer layers than the baselines'."""
    if len(at_m) != len(PROJ):
        return {}
    return {key: sum(r[key] for r in at_m) * 32 / 1000 for key in keys
            if all(r.get(key) is not None for r in at_m)}


def step_totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row count, each GEMV kernel's ms a decode step (``_per_step``)."""
    keys = ("stripe_us", "stripe_h200_table_us", "tc16_h200_table_us", "kmajor_prior_us",
            "kmajor_best_us")
    return {str(m): _per_step([r for r in rows if r.get("m") == m], keys) for m in ROWS}


def dequant_mm_totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row count of ``DEQUANT_ROWS``, bf16's and the whole-layer dequantise +
    cuBLAS route's ms a step (``_per_step``)."""
    mm = [r["dequant_mm"] for r in rows if "dequant_mm" in r]
    return {str(m): _per_step([r for r in mm if r["m"] == m], ("bf16_us", "whole_us"))
            for m in DEQUANT_ROWS}


def table_of(rows: list[dict[str, Any]]) -> dict[str, list]:
    """The ``--table`` JSON: per timed ``(m, projection)``, its fastest configuration."""
    return {"configs": [[r["m"], *PROJ[r["proj"]], list(r["kmajor_best"])]
                        for r in rows if r.get("kmajor_best")]}


if __name__ == "__main__":
    main()
