"""GPU microbenchmark of the fused-MoE kernels at Qwen3-30B-A3B and Mixtral-8x7B shapes.

    python -m pagedllm.benchmarks.moe_bench --out moe.json [--batches 1,4,16,64,256,1024,4096]

For each shape and token batch: routing from random router logits (so the expected
number of distinct experts hit at batch ``b`` is ``E * (1 - (1 - k/E)^b)``), a
correctness check of ``kernels/fused_moe.fused_experts`` (bf16) against the torch
reference in fp32, then timings (``triton.testing.do_bench`` medians, microseconds) of
the fused kernels and of the torch reference on the same GPU.  Two bounds per row:

* ``floor_us``: the weight-read floor, the bytes of the experts actually hit
  (``3 * H * I * 2`` bytes each) at ``--hbm-gbs`` (default 4,230 GB/s, the H200's
  measured copy rate in BENCHMARKS.md);
* ``ceiling_us``: the FLOP ceiling, ``2 * T * k * 3 * H * I`` at ``--tflops`` (default
  989, dense bf16).

``floor_frac`` = floor / time (the issue's batch-1 target is >= 0.8), ``flop_frac`` =
ceiling / time.  Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import torch

SHAPES = {  # name: (experts, top_k, hidden, moe intermediate, renormalise)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}


def _bench(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3


def bench_shape(name: str, batches: list[int], hbm_gbs: float, tflops: float,
                device: torch.device) -> list[dict[str, Any]]:
    from pagedllm.kernels.fused_moe import fused_experts
    from pagedllm.layers.fused_moe import select_experts
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    e, k, h, i, renorm = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=device, generator=g) * i ** -0.5).bfloat16()
    expert_bytes = 3 * h * i * 2
    rows = []
    for t in batches:
        x = torch.randn(t, h, device=device, generator=g).bfloat16()
        logits = torch.randn(t, e, device=device, generator=g)
        weights, ids = select_experts(logits, k, renorm)
        got = fused_experts(x, w13, w2, weights, ids).float()
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        hit = int(torch.unique(ids).numel())
        fused_us = _bench(partial(fused_experts, x, w13, w2, weights, ids))
        ref_us = _bench(partial(fused_experts_ref, x, w13, w2, weights, ids))
        floor_us = hit * expert_bytes / (hbm_gbs * 1e3)
        ceiling_us = 2 * t * k * 3 * h * i / (tflops * 1e6)
        rows.append(dict(shape=name, tokens=t, experts_hit=hit, rel_err=err,
                         fused_us=fused_us, torch_ref_us=ref_us, floor_us=floor_us,
                         ceiling_us=ceiling_us, floor_frac=floor_us / fused_us,
                         flop_frac=ceiling_us / fused_us))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--hbm-gbs", type=float, default=4230.0)
    ap.add_argument("--tflops", type=float, default=989.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_bench needs a CUDA device")
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
        rows += bench_shape(name, batches, args.hbm_gbs, args.tflops, device)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
