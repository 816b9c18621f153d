"""W4A16 kernel sweep on the GPU: correctness, then timings of every variant at the
Llama-3-8B projections, the best launch configuration per (M, projection), the per-step
totals over 32 layers, and the thresholds to use.  One device call (< 4 min).

    python benchmarks/wna16_sweep.py --out $OUT/wna16_sweep.json \\
        --table $OUT/wna16_configs.json [--budget-s 200]

``--table`` writes the best striped configurations in the format of
``PAGEDLLM_WNA16_CONFIGS`` (``kernels/wna16_stripe.tuned_table``), so the end-to-end run
can use them at once:

    PAGEDLLM_WNA16_CONFIGS=$OUT/wna16_configs.json python -m pagedllm bench latency \\
        --dummy llama3-8b-w4a16

Variants (W4, symmetric, group 128, bf16 activations, as ``--dummy llama3-8b-w4a16``):

* ``bf16``: the unquantised layer as the model runs it (``kernels/gemv.py`` at M = 1,
  cuBLAS ``F.linear`` above);
* ``tinygemm``: torch's ``_weight_int4pack_mm``;
* ``canonical``: ``kernels/wna16.py`` (the previous kernel), its default configuration;
* ``stripe``: ``kernels/wna16_stripe.py``, each configuration of a small grid (the GEMV
  for M <= 4, the tensor-core tile for M >= 2);
* ``dequant``: ``stripe_dequantize`` of the whole layer into a bf16 scratch + cuBLAS
  (M >= 64).

M <= 64 is timed as CUDA-graph replays over weight copies (> 256 MB: every call reads
HBM, no launch gaps: a decode step's cost); larger M with ``triton.testing.do_bench``.
Each compile is warmed in worker processes first (``--procs``) so that the budget goes to
timing.  Past ``--budget-s`` the remaining configurations are skipped (reported).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gpu_timing import bench_us, graph_us

ROWS = (1, 2, 4, 8, 16, 64, 256, 2048)
PROJ = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336)}
GROUP = 128
# (block_n, stripes, warps); kept where a thread holds <= 32 accumulator elements
GEMV_GRID = [(4, 8, 4), (4, 16, 4), (8, 4, 4), (8, 8, 4), (8, 16, 4), (8, 16, 8),
             (16, 4, 4), (16, 8, 8), (8, 2, 4)]
MMA_GRID = {  # block_m -> (block_n, stripes, warps, stages)
    16: [(32, 1, 4, 3), (32, 2, 4, 3), (64, 1, 4, 3), (64, 2, 4, 4), (64, 4, 4, 3),
         (128, 1, 4, 3)],
    64: [(64, 1, 4, 3), (64, 2, 4, 3), (128, 1, 4, 3), (128, 1, 8, 4)],
    128: [(128, 1, 8, 3), (128, 2, 8, 3), (256, 1, 8, 3), (128, 1, 4, 4)],
}
L2_FLUSH_BYTES = 256 << 20


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 4


def _split(m: int, n: int, k: int, bm: int, bn: int, stripes: int, sms: int) -> int:
    programs = -(-m // bm) * -(-n // bn)
    return max(1, min(2 * sms // programs, -(-k // (stripes * 128)), 16))


def stripe_configs(m: int, n: int, k: int, sms: int) -> list[tuple[int, ...]]:
    """The grid at this shape: (block_m, block_n, stripes, warps, stages, split)."""
    out: list[tuple[int, ...]] = []
    if m <= 4:  # the GEMV kernel takes up to 4 rows
        bm = 1 if m == 1 else 1 << (m - 1).bit_length()
        for bn, st, w in GEMV_GRID:
            if bm * bn * st * 16 > 32 * 32 * w:  # accumulator elements per thread
                continue
            out.append((bm, bn, st, w, 1, _split(m, n, k, bm, bn, st, sms)))
    if m >= 2:
        bm = 16 if m <= 16 else 64 if m <= 64 else 128
        for bn, st, w, stages in MMA_GRID[bm]:
            out.append((bm, bn, st, w, stages, _split(m, n, k, bm, bn, st, sms)))
    return out


def _weights(n: int, k: int, device: torch.device, seed: int = 0):
    from pagedllm.kernels.wna16 import pack_codes
    from pagedllm.kernels.wna16_stripe import to_stripes

    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32, generator=g)
    qw = pack_codes(codes, 4)
    scales = (torch.rand(n, k // GROUP, device=device, generator=g) * 2e-3 + 1e-3
              ).to(torch.bfloat16)
    return qw, to_stripes(qw, 4), scales


def _warm(jobs: list[tuple[str, int, tuple[int, ...] | None]]) -> None:
    """Worker process: compile (run once) each (projection, M, config); a config of None
    is the canonical kernel's default."""
    from pagedllm.kernels.wna16 import wna16_gemm
    from pagedllm.kernels.wna16_stripe import stripe_gemm

    dev = torch.device("cuda")
    cache: dict[str, Any] = {}
    for name, m, cfg in jobs:
        n, k = PROJ[name]
        if name not in cache:
            cache[name] = _weights(n, k, dev)
        qw, st, sc = cache[name]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        try:
            if cfg is None:
                wna16_gemm(x, qw, sc, None, None, 4, GROUP)
            else:
                stripe_gemm(x, st, sc, None, 4, GROUP, config=cfg)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001  (reported by the main process's run)
            print(f"warm {name} M={m} {cfg}: {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize()






def _quick_us(fn: Callable[[], Any]) -> float:
    return bench_us(fn, warmup=5, rep=25)


def _time(calls: list[Callable[[], Any]], m: int) -> float:
    """One call per weight copy: graph replay for decode-sized M, else the first call."""
    if m <= 64:
        return graph_us(calls)
    return _quick_us(calls[0])


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def correctness(dev: torch.device) -> list[dict[str, Any]]:
    """Each kernel at each projection against the fp32 reference (and the act-order
    layer path: permuted at load, equal to the unpermuted reference)."""
    from pagedllm.kernels.wna16 import wna16_ref
    from pagedllm.kernels.wna16_stripe import stripe_dequantize, stripe_gemm
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int_cuda import apply_cuda, store_cuda
    from pagedllm.layers.quantization.int_layout import IntWeight

    rows = []
    for name, (n, k) in PROJ.items():
        qw, st, sc = _weights(n, k, dev, seed=1)
        for m in (1, 3, 8, 16, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = wna16_ref(x.float(), qw, sc, None, None, 4, GROUP)
            r = {"proj": name, "M": m, "stripe": _rel(stripe_gemm(x, st, sc, None, 4, GROUP),
                                                       ref)}
            if m in (1, 256):
                w = stripe_dequantize(st, sc, None, 4, GROUP,
                                      torch.empty(n, k, device=dev, dtype=torch.bfloat16))
                r["dequant_linear"] = _rel(F.linear(x, w), ref)
            r["ok"] = all(v < 2e-2 for kk, v in r.items() if kk not in ("proj", "M"))
            rows.append(r)
            print("check", r, flush=True)
    # act-order + zero points through the layer storage (int_cuda), o_proj shape
    n, k = PROJ["o_proj"]
    g = torch.Generator(device=dev).manual_seed(2)
    codes = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32, generator=g)
    from pagedllm.kernels.wna16 import pack_codes

    qw = pack_codes(codes, 4)
    sc = (torch.rand(n, k // GROUP, device=dev, generator=g) * 2e-3 + 1e-3).to(torch.bfloat16)
    zp = torch.randint(0, 16, (n, k // GROUP), device=dev, generator=g).float()
    g_idx = (torch.argsort(torch.randperm(k, device=dev, generator=g)) // GROUP).int()
    iw = IntWeight(qw, sc, zp, g_idx, 4, GROUP)
    with torch.device(dev):
        layer = ReplicatedLinear(k, n, bias=False, prefix="sweep")
    layer.register_buffer("int_perm", None, persistent=False)
    store_cuda(layer, iw, torch.bfloat16)
    w_ref = iw.dequantize(torch.float32)
    for m in (1, 16, 600):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        r = {"proj": "o_proj act-order+zeros layer", "M": m, "layout": layer.int_layout,
             "stripe": _rel(apply_cuda(layer, x), x.float() @ w_ref.T)}
        r["ok"] = r["stripe"] < 2e-2
        rows.append(r)
        print("check", r, flush=True)
    return rows


def w8a8_quantiser(dev: torch.device) -> list[dict[str, Any]]:
    """The W8A8 layer's M = 1 cost per step (32 layers x 4 projections): the torch
    quantiser chain (before) and the one-launch Triton quantiser (now), each + int8 GEMM."""
    from pagedllm.kernels.int8_gemm import int8_gemm, quant_per_token_int8
    from pagedllm.layers.quantization.int8_w8a8 import quantize_int8_per_token

    out = []
    totals = {"torch_quant": 0.0, "triton_quant": 0.0}
    for name, (n, k) in PROJ.items():
        copies = max(1, -(-L2_FLUSH_BYTES // (n * k)))
        ws = [torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
              for _ in range(copies)]
        wsc = torch.rand(n, device=dev) * 1e-3
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

        def old(w: torch.Tensor, x: torch.Tensor = x, wsc: torch.Tensor = wsc
                ) -> torch.Tensor:
            q, s = quantize_int8_per_token(x)
            return int8_gemm(q, s, w, wsc, torch.bfloat16)

        def new(w: torch.Tensor, x: torch.Tensor = x, wsc: torch.Tensor = wsc
                ) -> torch.Tensor:
            q, s = quant_per_token_int8(x, compressed_tensors=True)
            return int8_gemm(q, s, w, wsc, torch.bfloat16)

        r = {"proj": name, "M": 1,
             "torch_quant_us": graph_us([partial(old, w) for w in ws]),
             "triton_quant_us": graph_us([partial(new, w) for w in ws])}
        totals["torch_quant"] += r["torch_quant_us"]
        totals["triton_quant"] += r["triton_quant_us"]
        out.append(r)
        print("w8a8", r, flush=True)
    out.append({"proj": "all_x32_layers", "M": 1,
                **{f"{k}_ms": 32 * v / 1e3 for k, v in totals.items()}})
    print("w8a8", out[-1], flush=True)
    return out


def _dequant_linear(x: torch.Tensor, st: torch.Tensor, sc: torch.Tensor,
                    scratch: torch.Tensor) -> torch.Tensor:
    from pagedllm.layers.quantization.int_cuda import dequant_linear

    return dequant_linear(x, st, sc, None, 4, GROUP, scratch.view(-1))


def sweep(dev: torch.device, budget_s: float, t0: float) -> tuple[list[dict], list[dict]]:
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.wna16 import unpack_codes, wna16_gemm
    from pagedllm.kernels.wna16_stripe import stripe_gemm
    from pagedllm.layers.quantization.int4pack import PackedInt4

    sms = _sms(dev)
    rows: list[dict] = []
    skipped: list[dict] = []
    # Order: what decides the targets first (M = 1, then prefill), then the rest.
    order = [1, 2048, 256, 16, 64, 4, 2, 8]
    for name, (n, k) in PROJ.items():
        b4 = n * k // 2 + n * (k // GROUP) * 2
        copies = max(1, -(-L2_FLUSH_BYTES // b4))
        base = _weights(n, k, dev)
        sets = [base] + [(base[0].clone(), base[1].clone(), base[2].clone())
                         for _ in range(copies - 1)]
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bcopies = max(1, -(-L2_FLUSH_BYTES // (2 * n * k)))
        wbs = [wb] + [wb.clone() for _ in range(bcopies - 1)]
        tiny = [PackedInt4(unpack_codes(qw, 4), s.float(),
                           torch.zeros_like(s, dtype=torch.float32), GROUP, dev)
                for qw, _, s in sets]
        scratch = torch.empty(n, k, device=dev, dtype=torch.bfloat16)
        for m in order:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res: dict[str, Any] = {"proj": name, "M": m, "N": n, "K": k}
            res["bf16"] = _time([partial(gemv if m == 1 else F.linear, x, w) for w in wbs],
                                m)
            res["tinygemm"] = _time([partial(t.mm, x) for t in tiny], m)
            if m <= 256:  # the old kernel at 2048 is 8x bf16: not worth the seconds
                res["canonical"] = _time([partial(wna16_gemm, x, qw, sc, None, None, 4,
                                                  GROUP) for qw, _, sc in sets], m)
            if m >= 64:
                res["dequant"] = _time([partial(_dequant_linear, x, st, sc, scratch)
                                        for _, st, sc in sets], m)
            res["stripe_default"] = _time([partial(stripe_gemm, x, st, sc, None, 4, GROUP)
                                           for _, st, sc in sets], m)
            best = None
            for cfg in stripe_configs(m, n, k, sms):
                if time.time() - t0 > budget_s:
                    skipped.append({"proj": name, "M": m, "config": cfg})
                    continue
                try:
                    us = _time([partial(stripe_gemm, x, st, sc, None, 4, GROUP, config=cfg)
                                for _, st, sc in sets], m)
                except Exception as e:  # noqa: BLE001  (a config that fails to compile)
                    print(f"config {cfg} at {name} M={m}: {type(e).__name__}: {e}",
                          flush=True)
                    continue
                if best is None or us < best[1]:
                    best = (cfg, us)
            if best is not None:
                res["stripe_best"], res["stripe_best_config"] = best[1], list(best[0])
            kinds = [c for c in ("bf16", "tinygemm", "canonical", "dequant",
                                 "stripe_default", "stripe_best") if c in res]
            res["winner_w4"] = min((c for c in kinds if c != "bf16"), key=lambda c: res[c])
            rows.append(res)
            print("time", json.dumps({kk: (round(v, 2) if isinstance(v, float) else v)
                                      for kk, v in res.items()}), flush=True)
        torch.cuda.empty_cache()
    return rows, skipped


def summarise(rows: list[dict]) -> dict[str, Any]:
    """Per M: each variant's time summed over the four projections x 32 layers (ms), and
    the thresholds (int_cuda's env vars) the measurements imply."""
    per_m: dict[int, dict[str, float]] = {}
    for r in rows:
        t = per_m.setdefault(r["M"], {})
        for c in ("bf16", "tinygemm", "canonical", "dequant", "stripe_default",
                  "stripe_best"):
            if c in r:
                t[c] = t.get(c, 0.0) + 32 * r[c] / 1e3
    complete = {m: t for m, t in per_m.items()
                if sum(1 for r in rows if r["M"] == m) == len(PROJ)}
    best_triton = {m: t.get("stripe_best", t.get("stripe_default", 1e9))
                   for m, t in complete.items()}
    # The smallest M from which dequantise + cuBLAS beats the tile.
    deq_ms = sorted(m for m, t in complete.items()
                    if "dequant" in t and t["dequant"] < best_triton[m])
    tiny_ms = sorted(m for m, t in complete.items() if t["tinygemm"] < best_triton[m])
    tiny_max = 0
    for m in sorted(complete):
        if m in tiny_ms:
            tiny_max = m
        else:
            break
    return {"per_step_ms_x32_layers": {str(m): {k: round(v, 3) for k, v in t.items()}
                                       for m, t in sorted(complete.items())},
            "dequant_min_m": deq_ms[0] if deq_ms else 0,
            "tinygemm_max_m": tiny_max}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="wna16_sweep.json")
    ap.add_argument("--table", default=None, help="write PAGEDLLM_WNA16_CONFIGS JSON here")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--procs", type=int, default=8, help="compile-warming processes")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    sms = _sms(dev)
    if args.procs > 0:
        jobs: list[tuple[str, int, tuple[int, ...] | None]] = [
            (name, m, cfg) for name, (n, k) in PROJ.items() for m in ROWS
            for cfg in stripe_configs(m, n, k, sms)]
        jobs += [(name, m, None) for name in PROJ for m in ROWS if m <= 256]
        chunks = [jobs[i::args.procs] for i in range(args.procs)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_warm, args=(c,)) for c in chunks]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print(f"warmed {len(jobs)} configurations in {time.time() - t0:.0f} s", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    result["correctness"] = correctness(dev)
    bad = [r for r in result["correctness"] if not r["ok"]]
    print(f"correctness: {len(result['correctness']) - len(bad)} ok, {len(bad)} FAILED",
          flush=True)
    result["w8a8_m1"] = w8a8_quantiser(dev)
    rows, skipped = sweep(dev, args.budget_s, t0)
    result["rows"], result["skipped"] = rows, skipped
    result["summary"] = summarise(rows)
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result["summary"], indent=1))
    print(f"{'proj':13} {'M':>5} {'bf16':>8} {'tiny':>8} {'canon':>8} {'deq':>8} "
          f"{'str_def':>8} {'str_best':>8}  best config (bm,bn,stripes,warps,stages,split)")
    for r in sorted(rows, key=lambda r: (r["proj"], r["M"])):
        def f(key: str, r: dict = r) -> str:
            return f"{r[key]:8.1f}" if key in r else f"{'-':>8}"
        print(f"{r['proj']:13} {r['M']:5d} {f('bf16')} {f('tinygemm')} {f('canonical')} "
              f"{f('dequant')} {f('stripe_default')} {f('stripe_best')}  "
              f"{r.get('stripe_best_config')}")
    print(f"skipped {len(skipped)} configurations (budget); {result['seconds']} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    if args.table:
        table = {"configs": [[r["M"], r["N"], r["K"], r["stripe_best_config"]]
                             for r in rows if "stripe_best_config" in r],
                 "summary": result["summary"]}
        with open(args.table, "w") as fh:
            json.dump(table, fh, indent=1)


if __name__ == "__main__":
    main()
