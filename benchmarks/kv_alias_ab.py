"""Does the KV cache's size or K/V layout change attention speed?  (A tuning aid.)

    python benchmarks/kv_alias_ab.py [--every 30] [--blocks 19072,54972,...] [--json F]

W1 ran at 9,150 tok/s with the default 54,972-block cache and at 8,840 with 19,072
blocks (``--kv-cache-memory-bytes 4e10``) in one H200 lease (2026-12-01), though both
hold all of W1 and the allocator hands out the same block ids.  Only the cache's
addresses differ: the offset from a block's keys to its values is ``num_blocks`` blocks.
This replays every ``--every``-th mixed step of W1 (``schedule_sim``) through the
current mixed-batch attention, with block ids drawn from the first blocks as the FIFO
allocator gives them, for several cache sizes and two layouts: "planes" (the engine's
``[2, blocks, ...]``, keys then values) and "interleaved" (``[blocks, 2, ...]`` behind
the same view: a block's keys and values adjacent).  It prints the estimated W1 seconds
of mixed-step attention per configuration.

Result (H200, 2026-12-01, docs/benchmarks.md run 12): 1.945-1.966 s for every size with
planes and 1.932-1.936 s interleaved, so the cache's size does not change attention's
speed; what slows W1 with a smaller cache is elsewhere (not found).  Interleaved K/V in
the engine ran W1 at 9,239 and 9,247 tok/s against 9,222 and 9,226 (same lease): within
noise, so the engine keeps its layout.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing
from mixed_attn_ab import BS, DIM, KV_HEADS, LAYERS, _plans, step_tensors
from schedule_sim import simulate

from pagedllm.kernels import paged_attention as pa


def make_cache(num_blocks: int, layout: str) -> torch.Tensor:
    shape = (BS, KV_HEADS, DIM)
    if layout == "interleaved":
        return torch.empty(num_blocks, 2, *shape, device="cuda",
                           dtype=torch.bfloat16).transpose(0, 1)
    return torch.empty(2, num_blocks, *shape, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--blocks", default="19072,54972,16384,32768,65536,27487,40961,54973")
    ap.add_argument("--layouts", default="planes,interleaved")
    ap.add_argument("--json")
    a = ap.parse_args()
    steps = [s for s in simulate("throughput", batches=True) if s["prefill"] > 0]
    sample = steps[::a.every]
    used = max(sum(math.ceil(b[1] / BS) for b in s["batch"]) for s in sample) + 1
    dev = torch.device("cuda")
    batches = []
    g = torch.Generator().manual_seed(0)
    for st in sample:
        batch = st["batch"]
        ids = torch.randperm(used - 1, generator=g) + 1  # the first blocks, as allocated
        batches.append((*step_tensors(batch, ids, dev), len(batch),
                        max(b[0] for b in batch)))
    rows = []
    for layout in a.layouts.split(","):
        for nb in (int(x) for x in a.blocks.split(",")):
            cache = make_cache(max(nb, used), layout)
            cache[:, :used].normal_()
            total = 0.0
            for q, tables, sl, qsl, n, mql in batches:
                dec, pre = _plans(n, mql)
                args = (q, cache, tables, sl, qsl, n, DIM ** -0.5, torch.empty_like(q),
                        pre, dec)
                total += triton.testing.do_bench(
                    lambda args=args: pa._mixed_launch(*args), warmup=3, rep=20) * 1e3
            w1 = total * a.every * LAYERS / 1e6
            rows.append(dict(layout=layout, num_blocks=nb, w1_s=w1))
            print(f"{layout:<12}{nb:>8}{w1:>8.3f}", flush=True)
            del cache, args
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
