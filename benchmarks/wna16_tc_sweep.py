"""W4A16 tensor-core GEMM sweep on the GPU (issue 21): every candidate configuration of
``kernels/wna16_tc.py`` checked for correctness at the Llama-3-8B projections, then the
checked ones timed against bf16 cuBLAS, dequantise + cuBLAS and the striped kernel, all
under CUDA-graph replay; prints the per-step totals (32 layers) and writes the launch
table to ship.  One device call (< 4 min):

    python benchmarks/wna16_tc_sweep.py --out $OUT/wna16_tc_sweep.json \
        --table $OUT/wna16_tc_NVIDIA_H200.json [--budget-s 150] [--rows 16,64,...]

``--table`` is the format of ``PAGEDLLM_WNA16_TC_CONFIGS`` (``kernels/wna16_tc_config``);
copy it to ``pagedllm/kernels/tuned/`` to ship it.  Per ``(M, projection)`` the table
holds the faster of the best ``tc`` configuration and ``dequant``; its
``summary.tc_min_m`` is the smallest swept M from which that choice beats the
striped kernel summed over the four projections (below it the striped path stays).

Safety (H200 run 1: wrong results, then an illegal address that killed the run):

* Check first, in ``--procs`` worker processes (they also warm the compile cache): each
  configuration against the fp32 reference, with zero points and symmetric (the K-major
  layers ship both kernel paths), twice on the same input (the bits must agree: a race
  or a read of uninitialised memory shows).  A CUDA error is sticky
  in a context, so a worker that hits one reports it and exits; its unchecked jobs go to
  a fresh worker.
* Only configurations that passed are ever run in this process (timed, re-checked
  after timing); a CUDA error while timing stops the timing and the table is written
  from the rows finished before it.

Timing: every variant is a CUDA graph that runs one call per weight copy (> 256 MB of
copies: every call reads its weight from HBM, as in a real step), median of 10 replays.
Past ``--budget-s`` the remaining configurations are skipped (reported).

Rows: an entry serves every M up to its own, so the grid must be fine where the faster
path changes and at the step sizes W1 runs: decode steps of up to 256 rows and mixed
steps filled to chunk-graph sizes (``prefill_pacing.fill_sizes``; int4 on the H100,
2026-12-07: 1,024 or 1,280 tokens).  With entries at 256 and 1,024 only, every step of
257-1,024 rows took the 1,024 entry's dequantise + cuBLAS, ~8 ms a step above bf16
however few rows it has (per step of 32 layers: the kernel 10.5 ms at 256 rows, 18.1 at
512; dequantise + cuBLAS 14.9 and 17.4): the crossover lies between.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gpu_timing import graph_us

ROWS = (16, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048)
PROJ = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336)}
GROUP = 128
L2_FLUSH_BYTES = 256 << 20
TOL = 2 ** -7  # bf16 output rounding (2**-8 relative) plus fp32 summation order
# (block_m, block_n, block_k, group_m, warps, stages, swap, scale_after); split: auto.
# block_m 256 (wgmma N = 256 with the register A operand): half the instructions and
# shared-memory traffic per MAC of block_m 128 (sm_90 SASS: 462 against 2 x 382 a step);
# H100 2026-12-07: the fastest at 256-2,048 rows of most projections (gate_up 1,024 rows
# 441 µs against 627).  Its 64-input K tiles failed the check (racy bits, as 128 x 256 x
# 64 does), its 2-stage pipeline never won: neither is a candidate.
GRID: dict[str, list[tuple[int, ...]]] = {
    "small": [(16, 64, 128, 1, 4, 4, 1, 0), (16, 128, 128, 1, 4, 4, 1, 0),
              (16, 128, 128, 1, 4, 4, 1, 1), (16, 128, 128, 1, 4, 6, 1, 0),
              (16, 256, 128, 1, 8, 4, 1, 0), (16, 64, 128, 1, 4, 6, 1, 1),
              (16, 128, 64, 1, 4, 6, 1, 0)],
    "mid": [(64, 128, 64, 4, 4, 4, 1, 0), (64, 128, 128, 4, 4, 3, 1, 0),
            (64, 256, 64, 4, 8, 3, 1, 0), (64, 128, 64, 4, 8, 4, 1, 0),
            (64, 256, 128, 4, 8, 3, 1, 0), (64, 64, 128, 4, 4, 4, 1, 1),
            (32, 128, 128, 4, 4, 4, 1, 0), (64, 128, 128, 4, 4, 3, 0, 0)],
    "large": [(128, 128, 64, 8, 8, 4, 1, 0), (128, 256, 64, 8, 8, 3, 1, 0),
              (128, 128, 128, 8, 8, 3, 1, 0), (128, 256, 128, 8, 8, 3, 1, 0),
              (128, 256, 64, 8, 8, 3, 0, 0), (128, 128, 128, 8, 8, 3, 0, 0),
              (256, 128, 128, 8, 8, 3, 1, 0)],
}
Job = tuple[str, int, tuple[int, ...]]


def _bucket(m: int) -> str:
    return "small" if m <= 16 else "mid" if m <= 64 else "large"


def candidates(m: int, n: int, k: int, dev: torch.device) -> list[tuple[int, ...]]:
    """Full configurations at this shape, the priors' first (split-K: the dispatcher's
    auto split, made a divisor of the K steps as the kernel does)."""
    from pagedllm.kernels.wna16_tc import even_split
    from pagedllm.kernels.wna16_tc_config import auto_split, prior_config

    out = [tuple(prior_config(m, n, k, dev))]
    for bm, bn, bk, gm, w, st, swap, after in GRID[_bucket(m)]:
        split = even_split(k, bk, auto_split(m, n, k, bm, bn, bk, dev))[1]
        cfg = (bm, bn, bk, gm, w, st, split, swap, after)
        if cfg not in out:
            out.append(cfg)
    return [(*c[:6], even_split(k, c[2], c[6])[1], *c[7:]) for c in out]


def _weights(n: int, k: int, device: torch.device, seed: int = 0):
    """``(canonical qweight, striped, k-major, scales [N, K/G], scales_t, zeros_t, zeros)``
    with random zero points; ``zeros_t`` in the scales' dtype (exact integers), as the
    K-major layers store them (``int_cuda._kmajor_zeros``)."""
    from pagedllm.kernels.wna16 import pack_codes
    from pagedllm.kernels.wna16_stripe import to_stripes
    from pagedllm.kernels.wna16_tc import to_kmajor

    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32, generator=g)
    qw = pack_codes(codes, 4)
    sc = (torch.rand(n, k // GROUP, device=device, generator=g) * 2e-3 + 1e-3
          ).to(torch.bfloat16)
    zp = torch.randint(0, 16, (n, k // GROUP), device=device, generator=g).float()
    return (qw, to_stripes(qw, 4), to_kmajor(qw), sc, sc.t().contiguous(),
            zp.t().contiguous().to(sc.dtype), zp)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _check_worker(jobs: list[tuple[int, Job]], path: str) -> None:
    """Worker process: compile and check each job, one JSON line each to ``path``
    (flushed); on an exception (maybe a sticky CUDA error) report it and exit."""
    from pagedllm.kernels.wna16 import wna16_ref
    from pagedllm.kernels.wna16_tc import w4a16_tc_gemm

    dev = torch.device("cuda")
    cache: dict[str, Any] = {}
    with open(path, "a") as fh:
        for i, (name, m, cfg) in jobs:
            rec: dict[str, Any] = {"i": i}
            try:
                n, k = PROJ[name]
                if name not in cache:
                    cache[name] = _weights(n, k, dev, seed=1)
                qw, _, qt, sc, sct, zt, zp = cache[name]
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                errs, same = [], True
                for zs, zr in ((zt, zp), (None, None)):  # zero points, then symmetric
                    ref = wna16_ref(x.float(), qw, sc, zr, None, 4, GROUP)
                    got = w4a16_tc_gemm(x, qt, sct, zs, GROUP,
                                        config=cfg)  # type: ignore[arg-type]
                    again = w4a16_tc_gemm(x, qt, sct, zs, GROUP,
                                          config=cfg)  # type: ignore[arg-type]
                    torch.cuda.synchronize()
                    errs.append(_rel(got, ref))
                    same = same and bool(torch.equal(got, again))
                rec["err"], rec["err_symmetric"] = errs
                rec["same_bits"] = same
                rec["ok"] = max(errs) < TOL and same
            except Exception as e:  # noqa: BLE001  (reported; the context may be dead)
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                os._exit(3)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()


def _read(path: str) -> dict[int, dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:  # a worker killed mid-line (deadline) leaves a partial one
                    rec = json.loads(line)
                except ValueError:
                    continue
                got[rec["i"]] = rec
    return got


def check_all(jobs: list[Job], procs: int, deadline: float) -> dict[int, dict[str, Any]]:
    """``{job index: {"ok", "err", "same_bits" | "error"}}`` for every job, checked in
    ``procs`` worker processes (module doc).  A worker that exits early is replaced at
    once by a fresh one for its unchecked jobs; the first job it did not report killed
    it (``crashed``).  Jobs not reached before ``deadline`` fail (``not checked``)."""
    ctx = mp.get_context("spawn")
    results: dict[int, dict[str, Any]] = {}
    tmp = tempfile.mkdtemp(prefix="wna16_tc_check_")
    indexed = list(enumerate(jobs))
    queue = [indexed[i::procs] for i in range(procs) if indexed[i::procs]]
    active: list[tuple[Any, list[tuple[int, Job]], str]] = []
    started = 0

    def start(part: list[tuple[int, Job]]) -> None:
        nonlocal started
        path = os.path.join(tmp, f"w{started}.jsonl")
        started += 1
        p = ctx.Process(target=_check_worker, args=(part, path))
        p.start()
        active.append((p, part, path))

    for part in queue:
        start(part)
    while active:
        time.sleep(0.2)
        expired = time.time() > deadline
        for entry in list(active):
            p, part, path = entry
            if p.is_alive() and not expired:
                continue
            if p.is_alive():
                p.kill()
            p.join()
            active.remove(entry)
            got = _read(path)
            results.update(got)
            left = [j for j in part if j[0] not in got]
            if not left:
                continue
            if expired:
                for i, _ in left:
                    results[i] = {"i": i, "ok": False, "error": "not checked (budget)"}
                continue
            if not any("error" in rec for rec in got.values()):
                # no reported error: the first unreported job killed it without a word
                results[left[0][0]] = {"i": left[0][0], "ok": False,
                                       "error": f"crashed (exit code {p.exitcode})"}
                left = left[1:]
            if left:
                start(left)
    return results


def _is_cuda_error(e: BaseException) -> bool:
    return "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"


def sweep(dev: torch.device, rows: tuple[int, ...], passed: dict[Job, float],
          budget_s: float, t0: float) -> tuple[list[dict], list[dict], str | None]:
    """Times the baselines and every configuration in ``passed`` (checked, with its
    error); ``(rows, skipped, fatal CUDA error or None)``."""
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.wna16 import wna16_ref
    from pagedllm.kernels.wna16_stripe import stripe_gemm
    from pagedllm.kernels.wna16_tc import w4a16_tc_gemm
    from pagedllm.kernels.wna16_tc_config import prior_config
    from pagedllm.layers.quantization.int_cuda import dequant_linear

    res_rows: list[dict] = []
    skipped: list[dict] = []
    for name, (n, k) in PROJ.items():
        copies = max(1, -(-L2_FLUSH_BYTES // (n * k // 2)))
        base = _weights(n, k, dev)
        sets = [base] + [tuple(t.clone() for t in base) for _ in range(copies - 1)]
        bcopies = max(1, -(-L2_FLUSH_BYTES // (2 * n * k)))
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wbs = [wb] + [wb.clone() for _ in range(bcopies - 1)]
        scratch = torch.empty(n * k, device=dev, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            r: dict[str, Any] = {"proj": name, "M": m, "N": n, "K": k}
            r["bf16"] = graph_us([partial(gemv if m == 1 else F.linear, x, w) for w in wbs])
            if m <= 256:  # far behind above (docs/benchmarks.md): not worth the seconds
                r["stripe"] = graph_us([partial(stripe_gemm, x, s[1], s[3], s[6], 4,
                                                GROUP) for s in sets])
            if m >= 16:
                r["dequant"] = graph_us([partial(dequant_linear, x, s[1], s[3], s[6], 4,
                                                 GROUP, scratch) for s in sets])
            ref = wna16_ref(x.float(), base[0], base[3], base[6], None, 4, GROUP)
            prior = tuple(prior_config(m, n, k, dev))
            best = None
            for cfg in candidates(m, n, k, dev):
                if (name, m, cfg) not in passed:
                    continue  # failed its check (or never checked): never run here
                if time.time() - t0 > budget_s:
                    skipped.append({"proj": name, "M": m, "config": cfg})
                    continue
                try:
                    us = graph_us([partial(w4a16_tc_gemm, x, s[2], s[4], s[5], GROUP,
                                           config=cfg) for s in sets])
                    err = _rel(w4a16_tc_gemm(x, base[2], base[4], base[5], GROUP,
                                             config=cfg), ref)
                except Exception as e:  # noqa: BLE001
                    print(f"config {cfg} at {name} M={m}: {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
                    if _is_cuda_error(e):  # sticky: nothing more runs in this process
                        return res_rows, skipped, f"{name} M={m} {cfg}: {e}"[:400]
                    continue
                if not err < TOL:  # wrong after timing: never ship it
                    print(f"config {cfg} at {name} M={m}: WRONG after timing "
                          f"(rel err {err:.2e})", flush=True)
                    continue
                if cfg == prior:
                    r["tc_prior"] = us
                r.setdefault("tc_all", {})[",".join(map(str, cfg))] = round(us, 2)
                if best is None or us < best[1]:
                    best = (cfg, us)
            if best is not None:
                r["tc"], r["tc_config"] = best[1], list(best[0])
            res_rows.append(r)
            print("time", json.dumps({kk: (round(v, 2) if isinstance(v, float) else v)
                                      for kk, v in r.items() if kk != "tc_all"}), flush=True)
        del sets, wbs, scratch
        torch.cuda.empty_cache()
    return res_rows, skipped, None


def summarise(rows: list[dict]) -> dict[str, Any]:
    """Per M: each variant summed over the four projections x 32 layers (ms); the
    table's choice (faster of tc and dequant per projection) and the smallest M from
    which that choice beats the striped kernel."""
    per_m: dict[int, dict[str, float]] = {}
    for r in rows:
        t = per_m.setdefault(r["M"], {})
        for c in ("bf16", "stripe", "dequant", "tc", "tc_prior"):
            if c in r:
                t[c] = t.get(c, 0.0) + 32 * r[c] / 1e3
        pick = min((r[c] for c in ("tc", "dequant") if c in r), default=None)
        if pick is not None:
            t["chosen"] = t.get("chosen", 0.0) + 32 * pick / 1e3
    complete = {m: t for m, t in per_m.items()
                if sum(1 for r in rows if r["M"] == m) == len(PROJ)}
    wins = [m for m, t in sorted(complete.items())
            if t.get("chosen", 1e9) < t.get("stripe", 1e18)]
    min_m = 0
    for m in sorted(complete, reverse=True):  # the run of wins that reaches the top
        if m in wins:
            min_m = m
        else:
            break
    return {"per_step_ms_x32_layers": {str(m): {k: round(v, 3) for k, v in t.items()}
                                       for m, t in sorted(complete.items())},
            "tc_min_m": min_m}


def table(rows: list[dict], summary: dict[str, Any], source: str) -> dict[str, Any]:
    configs = []
    for r in sorted(rows, key=lambda r: (r["N"], r["K"], r["M"])):
        if r["M"] < 16 or ("tc" not in r and "dequant" not in r):
            continue
        if "tc" in r and r["tc"] <= r.get("dequant", 1e18):
            configs.append([r["M"], r["N"], r["K"], "tc", r["tc_config"]])
        else:
            configs.append([r["M"], r["N"], r["K"], "dequant", None])
    return {"configs": configs, "summary": summary, "source": source}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="wna16_tc_sweep.json")
    ap.add_argument("--table", default=None, help="write PAGEDLLM_WNA16_TC_CONFIGS JSON")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--check-s", type=float, default=0.0,
                    help="time for the checks (default: 60%% of the budget)")
    ap.add_argument("--procs", type=int, default=15, help="checking worker processes")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    rows = tuple(int(v) for v in args.rows.split(","))
    t0 = time.time()
    dev = torch.device("cuda")
    jobs: list[Job] = [(name, m, cfg) for name, (n, k) in PROJ.items() for m in rows
                       for cfg in candidates(m, n, k, dev)]
    check_s = args.check_s or 0.6 * args.budget_s
    checks = check_all(jobs, max(1, args.procs), t0 + check_s)
    passed = {jobs[i]: rec["err"] for i, rec in checks.items() if rec["ok"]}
    failed = [{"proj": jobs[i][0], "M": jobs[i][1], "config": list(jobs[i][2]), **rec}
              for i, rec in sorted(checks.items()) if not rec["ok"]]
    for f in failed:
        print("check FAILED", json.dumps(f), flush=True)
    print(f"checked {len(jobs)} configurations in {time.time() - t0:.0f} s: "
          f"{len(passed)} ok, {len(failed)} failed", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "checked": len(jobs),
                              "check_failed": failed}
    res_rows, skipped, fatal = sweep(dev, rows, passed, args.budget_s, t0)
    result["rows"], result["skipped"], result["fatal"] = res_rows, skipped, fatal
    result["summary"] = summarise(res_rows)
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result["summary"], indent=1))
    print(f"{'proj':13} {'M':>5} {'bf16':>8} {'stripe':>8} {'dequant':>8} {'prior':>8} "
          f"{'tc':>8}  tc config (bm,bn,bk,gm,warps,stages,split,swap,after)")
    for r in sorted(res_rows, key=lambda r: (r["proj"], r["M"])):
        def f(key: str, r: dict = r) -> str:
            return f"{r[key]:8.1f}" if key in r else f"{'-':>8}"
        print(f"{r['proj']:13} {r['M']:5d} {f('bf16')} {f('stripe')} {f('dequant')} "
              f"{f('tc_prior')} {f('tc')}  {r.get('tc_config')}")
    print(f"skipped {len(skipped)} configurations (budget); {result['seconds']} s")
    if fatal:
        print(f"FATAL CUDA error while timing (table from the rows before it): {fatal}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    if args.table:
        src = (f"benchmarks/wna16_tc_sweep.py on one {result['device']}, Llama-3-8B "
               f"projections, rows {args.rows}; every tc entry passed its GPU check")
        with open(args.table, "w") as fh:
            json.dump(table(res_rows, result["summary"], src), fh, indent=1)
        print(json.dumps(table(res_rows, result["summary"], src)))


if __name__ == "__main__":
    main()
