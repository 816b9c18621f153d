"""GPU microbenchmark of the fused-MoE kernels at Qwen3-30B-A3B and Mixtral-8x7B shapes.

    python benchmarks/moe_bench.py --out moe.json [--batches 1,4,16,64,256,1024,4096]
    python benchmarks/moe_bench.py --sweep --out sweep.json [--budget-s 140]
    python benchmarks/moe_bench.py --sweep --decode-only --out sweep.json
    python benchmarks/moe_bench.py --decode-configs sweep.json --out moe.json

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
  ``layer_graph_us``: routing and experts together as ``FusedMoE.forward`` runs them
  (graph-replayed, own logits per call; on the decode path the top-k is computed
  inside the expert kernels; ``layer_floor_frac`` = floor / that), against
  ``layer_unfused_graph_us`` (the routing launch, then the experts) and
  ``layer_rel_err`` (bf16 against fp32 experts, same routing);
* ``torch_ref_us``: the torch reference (one grouped matmul per expert), do_bench.

Two bounds per row: ``floor_us``, the weight-read floor (bytes of the experts actually
hit, ``3 * H * I * 2`` each, at ``--hbm-gbs``, default 4,230 GB/s, the H200's measured
copy rate), and ``ceiling_us``, the FLOP ceiling (``2 * T * k * 3 * H * I`` at
``--tflops``, default 989 dense bf16).  ``floor_frac`` = floor / graph time (the issue's
batch-1 target is >= 0.8), ``flop_frac`` = ceiling / graph time.

``--sweep`` times candidate launch configs of the sorted path (graph-timed) at a few
batches per shape, within ``--budget-s`` seconds (each batch's candidates are compiled
on a thread pool first), then the decode path's ``DecodeConfig`` choices (gate-up and
down tiles, warps, the all-slots or slot-loop down kernel; ``_sweep_decode``, timed
with routing as the layer runs it: in-kernel where the config allows) at T = 1,
2, 4, 8, and prints the ``CONFIGS`` and ``DECODE_CONFIGS`` entries for
``kernels/fused_moe_configs.py``; ``--decode-only`` skips the sorted path (about a
minute a shape).  ``--decode-configs SWEEP_JSON`` then times the bench rows as if that
sweep's ``DECODE_CONFIGS`` were pasted.  Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from gpu_timing import bench_us, graph_us

SHAPES = {  # name: (experts, top_k, hidden, moe intermediate, renormalise)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
    # Tuned on an H100 (12-05); the H200's sweep (12-07) found nothing 3% better.
    "deepseek-v2-lite": (64, 6, 2048, 1408, False),
}
# Token counts to sweep: W4's 512-token prompt and W1's mixed steps of 384-512 tokens (the
# throughput policy) land on the 512 entry -- Qwen3's gained 16% a layer there on the H200.
SWEEP_BATCHES = {"qwen3-30b-a3b": (16, 64, 256, 512, 1024, 4096),
                 "mixtral-8x7b": (8, 32, 128, 512, 2048),
                 "deepseek-v2-lite": (16, 64, 256, 512, 1024, 4096)}






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


def _layer(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           k: int, renorm: bool, fuse_routing: bool = True) -> torch.Tensor:
    """``FusedMoE.forward`` without the module: routing inside the decode kernels where
    that applies (``fused_experts_routed``), else ``select_experts`` then the experts
    (always, with ``fuse_routing=False``)."""
    from pagedllm.kernels.fused_moe import fused_experts, fused_experts_routed
    from pagedllm.layers.fused_moe import select_experts

    out = fused_experts_routed(x, w13, w2, logits, k, renorm) if fuse_routing else None
    if out is None:
        weights, ids = select_experts(logits, k, renorm)
        out = fused_experts(x, w13, w2, weights, ids)
    return out


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
        # The layer as a decode step runs it: routing from bf16 logits, then the experts.
        gl = torch.Generator(device=device).manual_seed(t)
        layer_in = [(xx, torch.randn(t, e, device=device, generator=gl).bfloat16())
                    for xx, _, _ in inputs]
        row["layer_graph_us"] = graph_us([partial(_layer, xx, lg, w13, w2, k, renorm)
                                          for xx, lg in layer_in])
        row["layer_floor_frac"] = floor_us / row["layer_graph_us"]
        row["layer_unfused_graph_us"] = graph_us([
            partial(_layer, xx, lg, w13, w2, k, renorm, fuse_routing=False)
            for xx, lg in layer_in])
        lw, lids = select_experts(layer_in[0][1], k, renorm)
        ref_l = fused_experts_ref(layer_in[0][0].float(), w13.float(), w2.float(), lw, lids)
        got_l = _layer(layer_in[0][0], layer_in[0][1], w13, w2, k, renorm).float()
        row["layer_rel_err"] = float((got_l - ref_l).abs().max()
                                     / ref_l.abs().max().clamp_min(1e-6))
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


def sweep(shapes: list[str], budget_s: float, device: torch.device,
          decode_only: bool = False) -> dict[str, Any]:
    """Best sorted-path config per (shape, batch) within the time budget (none with
    ``decode_only``), then the decode path's per shape."""
    from pagedllm.kernels.fused_moe import fused_experts_sorted
    from pagedllm.kernels.fused_moe_configs import get_config

    t0 = time.monotonic()
    result: dict[str, Any] = {}
    per_shape = budget_s / len(shapes)
    for si, name in enumerate(shapes):
        e, k, h, i, renorm = SHAPES[name]
        w13, w2 = _weights(e, h, i, device)
        deadline = t0 + per_shape * (si + 1)
        batches = () if decode_only else SWEEP_BATCHES[name]
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
        if not r["table"]:
            continue
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
            print(f"    ({e}, {i}, {h}): {{  # {name}, swept on {torch.cuda.get_device_name()}")
            for t, row in r["decode"]["table"].items():
                print(f"        {t}: DecodeConfig{tuple(row['best'])},  # "
                      f"{row['best_us']:.1f} us (heuristic {row['heuristic_us']:.1f})")
            print("    },")
    return result


def _decode_candidates(k: int, h: int, i: int) -> tuple[list[tuple], list[tuple]]:
    """Gate-up ``(BLOCK_N, BLOCK_K, warps)`` and down ``(BLOCK_N, BLOCK_K, warps, all
    slots)`` choices worth timing: K steps of 512 up to the whole (power-of-two padded)
    row, at most 256 bytes of weights per thread per step (registers, no spills)."""
    import triton

    def per_thread(rows: int, bk: int, warps: int) -> float:
        return rows * bk * 2 / (32 * warps)

    h_p2, i_p2 = triton.next_power_of_2(h), triton.next_power_of_2(i)
    gate_up = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in sorted({512, 1024, h_p2})
               for w in (4, 8) if bk <= h_p2 and per_thread(2 * bn, bk, w) <= 256]
    down = [(bn, bk, w, True) for bn in (1, 2, 4, 8) for bk in sorted({256, 512, i_p2})
            for w in (2, 4, 8) if bk <= i_p2 and per_thread(k * bn, bk, w) <= 256]
    down += [(bn, bk, 4, False) for bn in (2, 4, 8) for bk in (256, 512) if bk <= i_p2]
    return gate_up, down


def _decode_layer(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, k: int, renorm: bool, config: Any,
                  warmup: bool = False) -> torch.Tensor | None:
    """The layer on the decode path with a forced ``DecodeConfig``, routing included, as
    ``FusedMoE.forward`` runs it: in the kernels where the config allows, else the
    routing launch then the experts."""
    from pagedllm.kernels.fused_moe_decode import (
        can_route_in_kernel,
        fused_experts_decode,
        fused_moe_decode_routed,
    )
    from pagedllm.layers.fused_moe import select_experts

    if can_route_in_kernel(logits, config):
        return fused_moe_decode_routed(x, w13, w2, logits, k, renorm, config, warmup)
    weights, ids = select_experts(logits, k, renorm)
    return fused_experts_decode(x, w13, w2, weights, ids, config, warmup)


def _sweep_decode(name: str, device: torch.device,
                  batches: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    """Graph-time the decode path's ``DecodeConfig`` choices, routing included (the
    layer as a decode step runs it, ``_decode_layer``; over 8 routings, as the bench
    rows): at T = 1 every gate-up choice with the heuristic's down kernel, then every
    down choice with the best gate-up, then the best 3 x 3 pairs and the best 4 with a
    routing launch instead of in-kernel routing; at each larger T (up to the path's
    limit) the 6 best of T = 1 and the heuristic."""
    from pagedllm.kernels.fused_moe import DECODE_MAX_PAIRS
    from pagedllm.kernels.fused_moe_configs import DecodeConfig
    from pagedllm.kernels.fused_moe_decode import default_decode_config
    from pagedllm.layers.fused_moe import select_experts
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    e, k, h, i, renorm = SHAPES[name]
    w13, w2 = _weights(e, h, i, device)
    t_max = max(1, min(DECODE_MAX_PAIRS, e) // k)
    batches = tuple(t for t in batches if t <= t_max)
    gate_up, down = _decode_candidates(k, h, i)
    base = default_decode_config(1, k, i, h)
    cands = {DecodeConfig(*g, *base[3:]) for g in gate_up}
    cands |= {DecodeConfig(*base[:3], *d) for d in down}
    g = torch.Generator(device=device).manual_seed(0)
    inputs = {t: [(torch.randn(t, h, device=device, generator=g).bfloat16(),
                   torch.randn(t, e, device=device, generator=g).bfloat16())
                  for _ in range(8)] for t in batches}
    _precompile(partial(_decode_layer, *inputs[1][0], w13, w2, k, renorm), sorted(cands))
    refs = {}
    for t in batches:
        xx, lg = inputs[t][0]
        ww, ii = select_experts(lg, k, renorm)
        refs[t] = fused_experts_ref(xx.float(), w13.float(), w2.float(), ww, ii)
    times: dict[tuple[int, DecodeConfig], float] = {}

    def timed(t: int, cfg: DecodeConfig) -> float:
        if (t, cfg) in times:
            return times[(t, cfg)]
        try:
            got = _decode_layer(*inputs[t][0], w13, w2, k, renorm, cfg)
        except Exception as exc:  # a config the compiler refuses (resources)
            print(f"# {name} T={t} {tuple(cfg)}: {type(exc).__name__}", flush=True)
            times[(t, cfg)] = float("inf")
            return float("inf")
        assert got is not None
        ref = refs[t]
        err = float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        us = float("inf")
        if err <= 1e-2:
            us = graph_us([partial(_decode_layer, xx, lg, w13, w2, k, renorm, cfg)
                           for xx, lg in inputs[t]], replays=5)
        else:
            print(f"# {name} T={t} {tuple(cfg)}: rel err {err:.3g}, skipped", flush=True)
        times[(t, cfg)] = us
        print(json.dumps({"shape": name, "tokens": t, "decode_config": list(cfg),
                          "us": us}), flush=True)
        return us

    heuristic = {t: default_decode_config(t, k, i, h) for t in batches}
    timed(1, heuristic[1])
    best_g = sorted(gate_up, key=lambda g: timed(1, DecodeConfig(*g, *base[3:])))
    best_d = sorted(down, key=lambda d: timed(1, DecodeConfig(*best_g[0], *d)))
    pairs = [DecodeConfig(*g, *d) for g in best_g[:3] for d in best_d[:3]]
    # Routing in the kernels (the default) against a routing launch, for the best few.
    top = sorted({c for (t, c) in times if t == 1}, key=lambda c: timed(1, c))[:4]
    unrouted = [c._replace(route_in_kernel=False) for c in top if c.down_all_slots]
    ranked = sorted(set(pairs) | set(unrouted) | {c for (t, c) in times if t == 1},
                    key=lambda c: timed(1, c))
    table: dict[int, Any] = {}
    for t in batches:
        pool = [heuristic[t], *ranked[:6]]
        best = min(pool, key=lambda c: timed(t, c))
        table[t] = dict(best=list(best), best_us=timed(t, best),
                        heuristic=list(heuristic[t]), heuristic_us=timed(t, heuristic[t]))
        print(json.dumps({"shape": name, "tokens": t, **table[t]}), flush=True)
    return dict(table=table, tried=len(times))


def _use_swept_decode_configs(path: str) -> None:
    """Install a ``--sweep`` JSON's decode winners into ``DECODE_CONFIGS`` (this process
    only), so one device run can sweep and then time what pasting them would give."""
    from pagedllm.kernels.fused_moe_configs import DECODE_CONFIGS, DecodeConfig

    with open(path) as f:
        swept = json.load(f)["sweep"]
    for name, r in swept.items():
        if "decode" in r:
            e, i, h = r["key"]
            DECODE_CONFIGS[(e, i, h)] = {int(t): DecodeConfig(*row["best"])
                                         for t, row in r["decode"]["table"].items()}
            print(f"# {name}: decode configs from {path}: {DECODE_CONFIGS[(e, i, h)]}",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--hbm-gbs", type=float, default=4230.0)
    ap.add_argument("--tflops", type=float, default=989.0)
    ap.add_argument("--sweep", action="store_true",
                    help="time launch configs of the sorted path instead")
    ap.add_argument("--decode-only", action="store_true",
                    help="--sweep: the decode path's configs alone (about a minute)")
    ap.add_argument("--decode-configs", metavar="SWEEP_JSON",
                    help="time the decode path with the DECODE_CONFIGS a --sweep run "
                    "wrote to SWEEP_JSON (as if pasted) instead of the file's")
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
        out: dict[str, Any] = {"sweep": sweep(shapes, args.budget_s, device,
                                           decode_only=args.decode_only)}
    else:
        if args.decode_configs:
            _use_swept_decode_configs(args.decode_configs)
        rows = []
        for name in shapes:
            rows += bench_shape(name, batches, args.hbm_gbs, args.tflops, device)
        out = {"rows": rows}
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **out}, f, indent=1)


if __name__ == "__main__":
    main()
