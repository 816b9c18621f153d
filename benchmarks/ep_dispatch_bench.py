"""CPU micro-benchmark of MoE token dispatch across data-parallel engines
(``layers/fused_moe/dispatch.py``): one ``FusedMoE`` layer over ``--dp`` gloo ranks (one
engine of TP 1 each, EP = DP), both backends, at a few token counts per engine.

    python benchmarks/ep_dispatch_bench.py [--tokens 8,256] [--runs 15] [--out r.json]

Rows per token count ``T`` (tokens per engine; every engine has ``T`` unless "idle"):

* ``one rank, all experts``: each rank runs the whole layer on its own ``T`` tokens, no
  collectives (the ranks run at the same time, so they share the host as in the others);
* ``allgather_reducescatter`` / ``alltoall``: the EP layer, ``E / dp`` experts a rank;
* ``... (engine 1 idle)``: engine 0 has ``T`` tokens, the others none (their
  ``forward_topk`` gets ``[0, H]``, as ``moe_dummy_pass`` calls it).

A run is one layer call on every rank, started together (a barrier); its time is the
slowest rank's.  The rows of one token count are timed round-robin (one run of each per
round), so load changes on the host spread over all of them.  Reported: the median and
the minimum over ``--runs`` runs (after ``--warmup``), in milliseconds, and the host's
load average before and after (other work on the host inflates and scatters the
numbers).  Routing comes from random router logits (``select_experts``).  Not a test:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _layer(e: int, k: int, h: int, inter: int) -> Any:
    """A ``FusedMoE`` in the current parallel context with seeded random weights (an EP
    rank keeps its own experts of the same full bank)."""
    from pagedllm.layers.fused_moe import FusedMoE

    layer = FusedMoE(e, k, h, inter, renormalize=True)
    g = torch.Generator().manual_seed(0)
    for ex in range(e):
        w13 = torch.randn(2 * inter, h, generator=g) * h ** -0.5
        w2 = torch.randn(h, inter, generator=g) * inter ** -0.5
        layer.weight_loader(layer.w13_weight, w13[:inter], "w1", ex)
        layer.weight_loader(layer.w13_weight, w13[inter:], "w3", ex)
        layer.weight_loader(layer.w2_weight, w2, "w2", ex)
    return layer


def _time(calls: list[Any], runs: int, warmup: int) -> list[list[float]]:
    """Per-call, per-run milliseconds (the slowest rank's; every call started together on
    every rank, after a barrier), ``warmup`` rounds first.  The calls are interleaved
    round by round, so a change in the host's load hits them all alike."""
    mine = [[0.0] * runs for _ in calls]
    for i in range(warmup + runs):
        for c, call in enumerate(calls):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                mine[c][i - warmup] = (time.perf_counter() - t0) * 1e3
    t = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.getcwd())
    from pagedllm.distributed.parallel_state import (
        destroy_parallel_state,
        init_parallel_state,
        parallel_context,
    )
    from pagedllm.layers.fused_moe import select_experts

    state = init_parallel_state(1, 1, 0, f"tcp://127.0.0.1:{port}", "gloo", 120.0,
                                expert_parallel=True, dp_size=args.dp, dp_rank=rank)
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.intermediate
    rows = []
    try:
        with torch.no_grad():
            full = _layer(e, k, h, inter)  # outside the context: one rank, all experts
            layers = {}
            for backend in ("allgather_reducescatter", "alltoall"):
                with parallel_context(dataclasses.replace(state, all2all_backend=backend)):
                    layers[backend] = _layer(e, k, h, inter)
            for t in args.tokens:
                g = torch.Generator().manual_seed(1000 * rank + t)
                x = torch.randn(t, h, generator=g)
                w, ids = select_experts(torch.randn(t, e, generator=g), k, True)
                cases: list[tuple[str, Any, int]] = [
                    ("one rank, all experts", full, t)]
                for backend, layer in layers.items():
                    cases.append((backend, layer, t))
                for backend, layer in layers.items():
                    cases.append((f"{backend} (engine 1 idle)", layer,
                                  t if rank == 0 else 0))
                calls = [partial(layer.forward_topk, x[:n], w[:n], ids[:n])
                         for _, layer, n in cases]
                for (name, _, _), times in zip(cases, _time(calls, args.runs, args.warmup)):
                    rows.append(dict(case=name, tokens=t, median_ms=statistics.median(times),
                                     min_ms=min(times), runs=times))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        destroy_parallel_state()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--dp", type=int, default=2, help="engines (ranks; TP 1 each)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (E)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (H)")
    ap.add_argument("--intermediate", type=int, default=512,
                    help="each expert's intermediate size")
    ap.add_argument("--tokens", default="8,256", help="tokens per engine, comma-separated")
    ap.add_argument("--runs", type=int, default=15, help="timed runs per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", help="also write the rows (every run's time) as JSON here")
    args = ap.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens: comma-separated integers, got {args.tokens!r}") from None
    if args.experts % args.dp:
        raise SystemExit(f"--experts {args.experts} must divide by --dp {args.dp}")
    from pagedllm.executor.multiproc import free_port

    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank_main, args=(args, free_port(), path), nprocs=args.dp,
                           join=True, start_method="spawn")
        with open(path) as f:
            rows = json.load(f)
    load1 = os.getloadavg()
    print(f"# dp={args.dp} gloo ranks x {args.threads} thread(s), {os.cpu_count()} CPUs; "
          f"FusedMoE {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, fp32; median (min) of {args.runs} runs, "
          f"slowest rank; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print("| case | " + " | ".join(f"ms / layer, {t} tokens" for t in args.tokens) + " |")
    print("| --- |" + " --- |" * len(args.tokens))
    for name in dict.fromkeys(r["case"] for r in rows):
        cells = [next(f"{r['median_ms']:.2f} ({r['min_ms']:.2f})" for r in rows
                      if r["case"] == name and r["tokens"] == t) for t in args.tokens]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_avg": [load0, load1], "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
