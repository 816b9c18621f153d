"""FP8 experts vs bf16 experts in the fused-MoE kernels, at Qwen3-30B-A3B and Mixtral-8x7B
expert shapes (one MoE layer, GPU only; not a test, nothing here asserts a time).

    python benchmarks/fp8_moe_probe.py --out fp8_moe.json [--batches 1,8,64,256,1024]

Per shape and token batch: the FP8 call's error against the torch reference in fp32 on
the dequantised weights (``rel_err``, max-abs over max-abs; a failure above 3e-2 is
printed as ``"ok": false``), then CUDA-graph medians in microseconds of one layer's
experts (``graph_us``, ``pagedllm.benchmarks.gpu_timing``; several routings per graph so
no call finds its weights in L2): ``bf16_us`` (``path="auto"``: the decode GEMVs at small
batches, the sorted GEMMs after), ``bf16_sorted_us`` (the sorted GEMMs forced: what FP8
changes, like for like) and ``fp8_us`` (the sorted GEMMs with ``W_FP8``, every batch).
``floor_us``: the experts hit times their bytes (bf16 2 B, FP8 1 B) at 4,230 GB/s.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import torch

from pagedllm.benchmarks.gpu_timing import graph_us
from pagedllm.kernels.fused_moe import fused_experts
from pagedllm.layers.fused_moe import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref
from pagedllm.layers.quantization.fp8 import quantize_fp8_rows

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
HBM_GBS = 4230.0


def _experts(e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
        w = torch.randn(e, rows, cols, device="cuda", generator=g) * cols ** -0.5
        out[name] = w.bfloat16()
        q, s = quantize_fp8_rows(w.reshape(-1, cols))
        out[name + "_q"] = q.reshape(e, rows, cols)
        out[name + "_s"] = s.reshape(e, rows).contiguous()
        del w
    return out


def probe(name: str, batches: list[int]) -> list[dict[str, Any]]:
    e, k, h, i = SHAPES[name]
    w = _experts(e, h, i)
    fp8 = dict(w13_scale=w["w13_s"], w2_scale=w["w2_s"])
    rows = []
    for t in batches:
        reps = 8 if t <= 64 else 2
        inputs = []
        for r in range(reps):
            g = torch.Generator(device="cuda").manual_seed(t * 100 + r)
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            inputs.append((x, *select_experts(torch.randn(t, e, device="cuda", generator=g),
                                              k, True)))
        x, tw, ti = inputs[0]
        # The reference upcasts each routed expert times its scales (fp32).
        ref = fused_experts_ref(x.float(), w["w13_q"], w["w2_q"], tw, ti, w["w13_s"],
                                w["w2_s"])
        got = fused_experts(x, w["w13_q"], w["w2_q"], tw, ti, **fp8).float()
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))

        def calls(*args: Any, inputs: list = inputs, **kw: Any) -> list[Any]:
            return [partial(fused_experts, xx, *args, ww, ii, **kw) for xx, ww, ii in inputs]

        hit = sum(int(torch.unique(ii).numel()) for _, _, ii in inputs) / reps
        row = dict(shape=name, tokens=t, experts_hit=hit, rel_err=err, ok=err < 3e-2,
                   bf16_us=graph_us(calls(w["w13"], w["w2"])),
                   bf16_sorted_us=graph_us(calls(w["w13"], w["w2"], path="sorted")),
                   fp8_us=graph_us(calls(w["w13_q"], w["w2_q"], **fp8)),
                   bf16_floor_us=hit * 3 * h * i * 2 / (HBM_GBS * 1e3),
                   fp8_floor_us=hit * 3 * h * i / (HBM_GBS * 1e3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256,1024")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [r for s in args.shapes.split(",") for r in probe(s, batches)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
