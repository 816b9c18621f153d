"""GPU microbenchmark of the fused-MoE kernels at Qwen3-30B-A3B and Mixtral-8x7B shapes.

    python -m pagedllm.benchmarks.moe_bench --out moe.json [--batches 1,4,16,64,256,1024,4096]
    python -m pagedllm.benchmarks.moe_bench --sweep --out sweep.json [--budget-s 140]

For each shape and token batch: routing from random router logits (so the expected
number of distinct experts hit at batch ``b`` is ``E * (1 - (1 - k/E)^b)``), a
correctness check of ``kernels/fused_moe.fused_experts`` (bf16) against the torch
reference in fp32 (every path that runs at that batch), then timings in microseconds:

* ``fused_us``: ``triton.testing.do_bench`` median of the call as the engine makes it
  (``path="auto"``), Python launch costs included (what an eager prefill sees);
* ``graph_us``: the same call replayed in a CUDA graph (what a decode step sees: no
  launch gaps), per call, over ``R`` calls each with its own routing (so that small
  batches do not find their experts' weights in L2 from the previous replay);
* ``decode_graph_us`` / ``sorted_graph_us``: both paths forced, graph-timed, where
  ``T * k <= 2 * DECODE_MAX_PAIRS`` (to place the switch-over); ``align_graph_us``: the
  sorted path's ``moe_align`` alone; ``routing_graph_us``: ``select_experts`` on bf16
  router logits (one ``kernels/moe_routing`` launch on CUDA), which the layer adds;
* ``torch_ref_us``: the torch reference (one grouped matmul per expert), do_bench.

Two bounds per row: ``floor_us``, the weight-read floor (bytes of the experts actually
hit, ``3 * H * I * 2`` each, at ``--hbm-gbs``, default 4,230 GB/s, the H200's measured
copy rate), and ``ceiling_us``, the FLOP ceiling (``2 * T * k * 3 * H * I`` at
``--tflops``, default 989 dense bf16).  ``floor_frac`` = floor / graph time (the issue's
batch-1 target is >= 0.8), ``flop_frac`` = ceiling / graph time.

``--sweep`` times candidate launch configs of the sorted path (graph-timed) at a few
batches per shape, within ``--budget-s`` seconds (each batch's candidates are compiled
on a thread pool first), then the decode path's 11 (BLOCK_N, BLOCK_N, warps) choices at
T = 1 (about a minute), and prints the ``CONFIGS`` and ``DECODE_CONFIGS`` entries for
``kernels/fused_moe_configs.py``.  Not a test:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pagedllm.benchmarks.gpu_timing import bench_us, graph_us

SHAPES = {  # name: (experts, top_k, hidden, moe intermediate, renormalise)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}
SWEEP_BATCHES = {"qwen3-30b-a3b": (16, 64, 256, 1024, 4096),
                 "mixtral-8x7b": (8, 32, 128, 512, 2048)}






def _weights(e: int, h: int, i: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=device, generator=g) * i ** -0.5).bfloat16()
    return w13, w2


def _inputs(t: int, e: int, k: int, h: int, renorm: bool, seed: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from pagedllm.layers.fused_moe import select_experts

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, device=device, generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(t, e, device=device, generator=g), k, renorm)
    return x, weights, ids


def bench_shape(name: str, batches: list[int], hbm_gbs: float, tflops: float,
                device: torch.device) -> list[dict[str, Any]]:
    from pagedllm.kernels.fused_moe import DECODE_MAX_PAIRS, fused_experts, moe_align
    from pagedllm.kernels.fused_moe_configs import get_config
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    e, k, h, i, renorm = SHAPES[name]
    w13, w2 = _weights(e, h, i, device)
    expert_bytes = 3 * h * i * 2
    rows = []
    for t in batches:
        reps = 8 if t <= 64 else 2
        inputs = [_inputs(t, e, k, h, renorm, seed=t * 100 + r, device=device)
                  for r in range(reps)]
        x, weights, ids = inputs[0]
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
        both = t * k <= 2 * DECODE_MAX_PAIRS
        paths = ("auto", "decode", "sorted") if both else ("auto",)
        err = {}
        for path in paths:
            got = fused_experts(x, w13, w2, weights, ids, path=path).float()
            err[path] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        hit = [int(torch.unique(r[2]).numel()) for r in inputs]
        floor_us = sum(hit) / reps * expert_bytes / (hbm_gbs * 1e3)
        ceiling_us = 2 * t * k * 3 * h * i / (tflops * 1e6)

        def calls(path: str, inputs: list = inputs) -> list[Callable[[], Any]]:
            return [partial(fused_experts, xx, w13, w2, ww, ii, path=path)
                    for xx, ww, ii in inputs]

        g_us = graph_us(calls("auto"))
        row: dict[str, Any] = dict(
            shape=name, tokens=t, experts_hit=hit[0], rel_err=err["auto"],
            fused_us=bench_us(partial(fused_experts, x, w13, w2, weights, ids)),
            graph_us=g_us,
            torch_ref_us=bench_us(partial(fused_experts_ref, x, w13, w2, weights, ids)),
            floor_us=floor_us, ceiling_us=ceiling_us, floor_frac=floor_us / g_us,
            flop_frac=ceiling_us / g_us)
        if both:
            row.update(decode_graph_us=graph_us(calls("decode")),
                       sorted_graph_us=graph_us(calls("sorted")),
                       decode_rel_err=err["decode"], sorted_rel_err=err["sorted"])
        from pagedllm.layers.fused_moe import select_experts

        logits = torch.randn(t, e, device=device).bfloat16()
        row["routing_graph_us"] = graph_us([partial(select_experts, logits, k, renorm)])
        bm = get_config(t, e, i, h, k)[0]
        row["align_graph_us"] = graph_us([partial(moe_align, ii, e, bm)
                                           for _, _, ii in inputs])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _candidates(tokens: int, e: int, k: int) -> list[tuple[int, int, int, int, int, int]]:
    """Launch configs worth timing at ``tokens``: M tiles by pairs per expert, then the
    N / K tiles and warps / stages vLLM's tuned tables use on Hopper."""
    per_expert = tokens * k / e
    if per_expert <= 8:
        bms = (16,)
    elif per_expert <= 32:
        bms = (16, 32)
    elif per_expert <= 96:
        bms = (32, 64)
    else:
        bms = (64, 128)
    out = []
    for bm in bms:
        group = 16 if bm >= 64 else 1
        for bn, bk in ((128, 128), (256, 64), (64, 128), (128, 64)):
            for warps, stages in ((4, 3), (8, 4)):
                if bm == 128 and bn == 256 and warps == 4:
                    continue  # 128x256 fp32 accumulators need 8 warps
                if (bm * bk + bk * bn) * 2 * stages > 220 * 1024:
                    continue  # bf16 tiles per pipeline stage past Hopper's shared memory
                out.append((bm, bn, bk, group, warps, stages))
    return out


def _precompile(call: Callable[..., Any], configs: list[Any]) -> None:
    """Compile ``call(config=c, warmup=True)`` for every config on a thread pool
    (Triton's ``AsyncCompileMode``; a private API, so any failure just leaves the
    compiles to the timed loop)."""
    try:
        import os
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool, \
                AsyncCompileMode(pool, ignore_errors=True):
            for cfg in configs:
                call(config=cfg, warmup=True)
    except Exception as exc:  # noqa: BLE001 -- best effort, see the docstring
        print(f"# precompile: {type(exc).__name__}: {exc}", flush=True)
    print(f"# precompiled {len(configs)} configs in {time.monotonic() - t0:.1f} s",
          flush=True)


def sweep(shapes: list[str], budget_s: float, device: torch.device) -> dict[str, Any]:
    """Best sorted-path config per (shape, batch) within the time budget."""
    from pagedllm.kernels.fused_moe import fused_experts_sorted
    from pagedllm.kernels.fused_moe_configs import get_config

    t0 = time.monotonic()
    result: dict[str, Any] = {}
    per_shape = budget_s / len(shapes)
    for si, name in enumerate(shapes):
        e, k, h, i, renorm = SHAPES[name]
        w13, w2 = _weights(e, h, i, device)
        deadline = t0 + per_shape * (si + 1)
        batches = SWEEP_BATCHES[name]
        table: dict[int, Any] = {}
        for bi, t in enumerate(batches):
            x, weights, ids = _inputs(t, e, k, h, renorm, seed=t, device=device)
            ref = fused_experts_sorted(x, w13, w2, weights, ids).float()
            current = get_config(t, e, i, h, k)
            cands = [current] + [c for c in _candidates(t, e, k) if c != current]
            _precompile(partial(fused_experts_sorted, x, w13, w2, weights, ids), cands)
            # Each batch gets its share of what is left of the shape's budget.
            until = time.monotonic() + (deadline - time.monotonic()) / (len(batches) - bi)
            timed = []
            for cfg in cands:
                if timed and time.monotonic() > until:
                    break
                try:
                    got = fused_experts_sorted(x, w13, w2, weights, ids, config=cfg).float()
                except Exception as exc:  # a config the compiler refuses (resources)
                    print(f"# {name} T={t} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                if err > 1e-2:
                    print(f"# {name} T={t} {cfg}: rel err {err:.3g}, skipped", flush=True)
                    continue
                us = graph_us([partial(fused_experts_sorted, x, w13, w2, weights, ids,
                                        config=cfg)], replays=5)
                timed.append((us, cfg))
            if not timed:
                continue
            timed.sort()
            best_us, best = timed[0]
            cur_us = next((us for us, c in timed if c == current), float("nan"))
            table[t] = dict(best=best, best_us=best_us, current=current, current_us=cur_us,
                            tried=len(timed), of=len(cands))
            print(json.dumps({"shape": name, "tokens": t, **table[t]}), flush=True)
        result[name] = dict(key=[e, i, h], table=table)
    for name in shapes:
        if time.monotonic() > t0 + budget_s + 60:
            break  # the decode sweep gets at most a minute past the budget
        result[name]["decode"] = _sweep_decode(name, device)
    print("\n# Paste into pagedllm/kernels/fused_moe_configs.py CONFIGS:")
    for name, r in result.items():
        e, i, h = r["key"]
        print(f"    ({e}, {i}, {h}): {{  # {name}, swept on {torch.cuda.get_device_name()}")
        for t, row in r["table"].items():
            print(f"        {t}: {tuple(row['best'])},  # {row['best_us']:.0f} us "
                  f"(was {row['current_us']:.0f})")
        print("    },")
    print("# ... and DECODE_CONFIGS:")
    for name, r in result.items():
        if "decode" in r:
            e, i, h = r["key"]
            d = r["decode"]
            print(f"    ({e}, {i}, {h}): {tuple(d['best'])},  # {name}: "
                  f"{d['best_us']:.1f} us at T=1 (heuristic {d['heuristic_us']:.1f})")
    return result


def _sweep_decode(name: str, device: torch.device) -> dict[str, Any]:
    """Graph-time the decode path's (gate-up BLOCK_N, down BLOCK_N, warps) at T = 1 over
    8 routings (as the bench rows do) and at the largest decode T as a check."""
    from pagedllm.kernels.fused_moe import DECODE_MAX_PAIRS
    from pagedllm.kernels.fused_moe_decode import fused_experts_decode

    e, k, h, i, renorm = SHAPES[name]
    w13, w2 = _weights(e, h, i, device)
    t_max = max(1, min(DECODE_MAX_PAIRS, e) // k)
    timed = []
    cands = [(a, b, 4) for a in (4, 8, 16) for b in (2, 4, 8)] + [(8, 4, 2), (8, 4, 8)]
    for cfg in [None, *cands]:
        us = []
        for t in (1, t_max):
            inputs = [_inputs(t, e, k, h, renorm, seed=t * 10 + r, device=device)
                      for r in range(8)]
            us.append(graph_us([partial(fused_experts_decode, xx, w13, w2, ww, ii,
                                         config=cfg) for xx, ww, ii in inputs], replays=5))
        timed.append((us[0], us[1], cfg))
        print(json.dumps({"shape": name, "decode_config": cfg, "t1_us": us[0],
                          f"t{t_max}_us": us[1]}), flush=True)
    heuristic = timed[0]
    best = min(timed[1:])
    return dict(best=best[2], best_us=best[0], best_tmax_us=best[1], t_max=t_max,
                heuristic_us=heuristic[0], heuristic_tmax_us=heuristic[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--hbm-gbs", type=float, default=4230.0)
    ap.add_argument("--tflops", type=float, default=989.0)
    ap.add_argument("--sweep", action="store_true",
                    help="time launch configs of the sorted path instead")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="--sweep: seconds for the sorted path's configs (compiles "
                    "included); the decode path's take about a minute more")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: comma-separated integers, got {args.batches!r}") from None
    if not torch.cuda.is_available():
        raise SystemExit("moe_bench needs a CUDA device")
    device = torch.device("cuda")
    if args.sweep:
        out: dict[str, Any] = {"sweep": sweep(shapes, args.budget_s, device)}
    else:
        rows = []
        for name in shapes:
            rows += bench_shape(name, batches, args.hbm_gbs, args.tflops, device)
        out = {"rows": rows}
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **out}, f, indent=1)


if __name__ == "__main__":
    main()
