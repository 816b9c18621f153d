"""Replay W1's mixed steps (as the real scheduler makes them) through attention variants.

    python benchmarks/mixed_attn_ab.py [--policy throughput] [--every 20] [--json FILE]

``schedule_sim.simulate`` runs W1 through the real scheduler (no model) and lists every
step's requests as (query_len, seq_len) pairs.  This script takes every ``--every``-th
step that holds prompt tokens, builds the batch on the GPU (Llama-3-8B heads: 32 query,
8 KV, head_dim 128, block size 16, bf16, blocks scattered at random) and times one
layer's attention under each variant (median of ``triton.testing.do_bench``).  It
prints, per variant, the estimated seconds of W1's mixed-step attention (sum over the
sampled steps x ``every`` x 32 layers), its ratio to the current kernel and the largest
difference of its output from the current kernel's.  A tuning aid, not a test.

"sorted" variants lay each step's requests out longest context first, so the long
decode programs start first.  That took 2-4% off this replay's attention in three H200
leases but nothing measurable off W1 in the engine (9,359 against 9,348 tok/s, medians of
two runs each, 2026-12-01), so the engine keeps the scheduler's order.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import triton
import triton.testing
from schedule_sim import simulate  # benchmarks/, on sys.path when run as a script

from pagedllm.kernels import paged_attention as pa

HEADS, KV_HEADS, DIM, BS, LAYERS = 32, 8, 128, 16, 32


def _plans(num_reqs: int, mql: int, beside_decodes: bool = True,
           ) -> tuple[pa.AttentionLaunch, pa.AttentionLaunch]:
    """The decode and prompt plans ``paged_attention`` picks for a mixed batch (with
    ``beside_decodes=False``: the prompt plan of a separate launch)."""
    return tuple(pa.plan_attention(num_reqs=num_reqs, max_query_len=m, num_heads=HEADS,
                                   num_kv_heads=KV_HEADS, block_size=BS, sm_count=132,
                                   num_splits=1, head_dim=DIM,
                                   beside_decodes=beside_decodes) for m in (1, mql))


def step_tensors(batch: list[list[int]], ids: torch.Tensor, dev: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One replayed step's ``(q, block_tables, seq_lens, query_start_loc)`` on ``dev``:
    ``batch`` is its ``[query_len, seq_len]`` pairs, ``ids`` the block ids to hand out
    in order (each request takes the next ``ceil(seq_len / BS)``); q is random bf16."""
    q_lens = [b[0] for b in batch]
    blocks = [math.ceil(b[1] / BS) for b in batch]
    ids = ids.to(dev, torch.int32)
    tables = torch.zeros(len(batch), max(blocks), dtype=torch.int32, device=dev)
    off = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = ids[off:off + nb]
        off += nb
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=dev)
    sl = torch.tensor([b[1] for b in batch], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), HEADS, DIM, device=dev, dtype=torch.bfloat16)
    return q, tables, sl, qsl


def variants() -> dict[str, tuple[bool, bool, Callable]]:
    """name -> (sort the batch longest context first, head-major cache, launch(q, cache,
    tables, sl, qsl, num_reqs, mql, out)).  A head-major cache holds each block's
    positions of one KV head contiguously (physically ``[2, blocks, kv_heads,
    block_size, dim]``) behind the usual ``[2, blocks, block_size, kv_heads, dim]``
    view: the kernels address the cache through its strides."""

    def mixed(dec_tile: int | None = None, pre_tile: int | None = None,
              pre_stages: int | None = None, dec_stages: int | None = None) -> Callable:
        def run(q, cache, tables, sl, qsl, n, mql, out):
            dec, pre = _plans(n, mql)
            dec = replace(dec, tile_n=dec_tile or dec.tile_n,
                          num_stages=dec_stages or dec.num_stages)
            pre = replace(pre, tile_n=pre_tile or pre.tile_n,
                          num_stages=pre_stages or pre.num_stages)
            pa._mixed_launch(q, cache, tables, sl, qsl, n, DIM ** -0.5, out, pre, dec)
        return run

    def two(q, cache, tables, sl, qsl, n, mql, out):
        dec, pre = _plans(n, mql, beside_decodes=False)
        for f, plan in ((1, dec), (2, pre)):
            pa._launch(q, cache, tables, sl, qsl, n, DIM ** -0.5, out, plan, f)

    def alone(q_filter: int, **plan_changes: int) -> Callable:
        def run(q, cache, tables, sl, qsl, n, mql, out):
            plan = replace(_plans(n, mql, beside_decodes=False)[q_filter - 1],
                           **plan_changes)
            pa._launch(q, cache, tables, sl, qsl, n, DIM ** -0.5, out, plan, q_filter)
        return run

    out: dict[str, tuple[bool, bool, Callable]] = {
        "current": (False, False, mixed()), "two launches": (False, False, two),
        "decodes alone": (False, False, alone(1)),
        "prompt chunks alone": (False, False, alone(2))}
    out["sorted"] = (True, False, mixed())
    out["sorted, prompt TILE_N 32, 2 stages"] = (True, False, mixed(pre_tile=32, pre_stages=2))
    out["sorted, head-major"] = (True, True, mixed())
    out["decodes alone, sorted"] = (True, False, alone(1))
    out["decodes alone, sorted, head-major"] = (True, True, alone(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="throughput")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    steps = [s for s in simulate(a.policy, batches=True) if s["prefill"] > 0]
    sample = steps[::a.every]
    dev, dt = torch.device("cuda"), torch.bfloat16
    max_ctx = max(sum(math.ceil(b[1] / BS) for b in s["batch"]) for s in sample)
    cache = torch.randn(2, max_ctx + 64, BS, KV_HEADS, DIM, device=dev, dtype=dt)
    # The same values, laid out head-major (see variants()).
    caches = {False: cache,
              True: cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)}
    vs = variants()
    total = {k: 0.0 for k in vs}
    err = {k: 0.0 for k in vs}
    kv_bytes = 0  # distinct KV bytes the sampled steps read (once per step)
    for st in sample:
        for srt in (False, True):
            batch = sorted(st["batch"], key=lambda b: -b[1]) if srt else st["batch"]
            n = len(batch)
            q_lens = [b[0] for b in batch]
            q, tables, sl, qsl = step_tensors(
                batch, torch.randperm(cache.shape[1], device=dev), dev)
            is_dec = torch.tensor([ql == 1 for ql in q_lens for _ in range(ql)], device=dev)
            kv_bytes += sum(b[1] for b in batch) * KV_HEADS * DIM * 2 * 2 if srt else 0
            ref = torch.empty_like(q)
            vs["current"][2](q, cache, tables, sl, qsl, n, max(q_lens), ref)
            for name, (want_sorted, hm, fn) in vs.items():
                if want_sorted != srt:
                    continue
                o = torch.full_like(q, float("nan"))  # poison: unwritten rows show
                args = (q, caches[hm], tables, sl, qsl, n, max(q_lens), o)
                fn(*args)
                rows = (is_dec if name.startswith("decodes alone") else
                        ~is_dec if name.startswith("prompt chunks alone") else None)
                d = (o.float() - ref.float()).abs()
                d = d if rows is None else d[rows]
                if d.numel():
                    err[name] = max(err[name], d.max().item())
                us = triton.testing.do_bench(
                    lambda fn=fn, args=args: fn(*args),
                    warmup=3, rep=20) * 1e3
                total[name] += us
    scale = a.every * LAYERS / 1e6
    base = total["current"]
    print(f"W1 ({a.policy}): {len(steps)} mixed steps, {len(sample)} sampled; "
          "estimated attention seconds over all mixed steps")
    print(f"{'variant':<28}{'W1 s':>8}{'ratio':>8}{'TB/s':>7}{'max err':>10}")
    rows = []
    for name in vs:
        tbs = kv_bytes / (total[name] * 1e-6) / 1e12  # of distinct KV, all programs'
        rows.append(dict(variant=name, w1_s=total[name] * scale, ratio=total[name] / base,
                         kv_tb_s=tbs, max_err=err[name]))
        print(f"{name:<28}{total[name] * scale:>8.3f}{total[name] / base:>8.3f}{tbs:>7.2f}"
              f"{err[name]:>10.2g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
