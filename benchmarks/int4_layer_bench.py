"""Int4 group-128 layers with and without zero points, through the engine's own routing
(``layers/quantization/int_cuda.apply_cuda``: striped GEMV, tensor-core GEMM or
dequantise + cuBLAS by row count), at the Llama-3-8B projections (fused qkv 6144x4096,
o_proj 4096x4096, fused gate_up 28672x4096, down_proj 4096x14336).

Issue 43 measured W4 TPOT 8.00 ms for a zero-point checkpoint against 2.70 ms for its
symmetric twin; this isolates the layer: per (shape, kind, M) the microseconds of one
call replayed in a CUDA graph over 4 weight copies (no L2 reuse; ``gpu_timing.graph_us``),
the relative error against the dequantised weight in fp32, and the bytes the layer
stores (both layouts: the weight-memory item of the issue).  The "zero_points striped"
rows time the striped GEMV on zero-point weights directly (M <= 4; the engine stores such
layers K-major): the candidate that would let them share the symmetric layout.

Usage (repository root, a CUDA device): ``python benchmarks/int4_layer_bench.py
[out.json]``.  Not a test: nothing asserts a time.
"""

from __future__ import annotations

import json
import sys

import torch
from gpu_timing import graph_us

from pagedllm.kernels.wna16 import pack_codes
from pagedllm.kernels.wna16_stripe import GEMV_MAX_M, stripe_gemm, to_stripes
from pagedllm.layers.quantization import int_cuda
from pagedllm.layers.quantization.int_layout import IntWeight

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
ROWS = (1, 2, 4, 8, 12, 16, 64, 256, 1024)
COPIES = 4


def layer(n: int, k: int, zero_points: bool) -> tuple[torch.nn.Module, IntWeight]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // 128, device="cuda") * 0.01 + 1e-3).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda").float() \
        if zero_points else None
    iw = IntWeight(pack_codes(codes, 4), scales, zeros, None, 4, 128)
    mod = torch.nn.Module()
    int_cuda.store_cuda(mod, iw, torch.bfloat16)  # type: ignore[arg-type]
    return mod, iw


def main() -> None:
    torch.manual_seed(0)
    res: dict[str, dict[str, float]] = {}
    for n, k in SHAPES:
        for kind in ("sym", "zero_points"):
            built = [layer(n, k, kind == "zero_points") for _ in range(COPIES)]
            mods = [m for m, _ in built]
            stored = sum(b.numel() * b.element_size() for b in mods[0].buffers())
            w_ref = built[0][1].dequantize().float()
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ w_ref.t()
                got = int_cuda.apply_cuda(mods[0], x).float()  # type: ignore[arg-type]
                err = float((got - ref).abs().max() / ref.abs().max())
                us = graph_us([lambda mod=mod, x=x: int_cuda.apply_cuda(mod, x)  # type: ignore
                               for mod in mods])
                key = f"{n}x{k} {kind} M={m}"
                res[key] = {"us": round(us, 1), "rel_err": err, "stored_mib": stored / 2**20}
                print(f"{n:>6}x{k:<6}{kind:>12} M={m:<5}{us:9.1f} us  rel err {err:.1e}  "
                      f"stored {stored / 2**20:.0f} MiB", flush=True)
                if kind == "zero_points" and m <= GEMV_MAX_M:
                    striped = [(to_stripes(iw.qweight, 4), iw.scales, iw.zeros)
                               for _, iw in built]
                    got = stripe_gemm(x, *striped[0], 4, 128).float()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    us = graph_us([lambda w=w, x=x: stripe_gemm(x, *w, 4, 128)
                                   for w in striped])
                    res[f"{key} striped"] = {"us": round(us, 1), "rel_err": err}
                    print(f"{n:>6}x{k:<6}{'zp striped':>12} M={m:<5}{us:9.1f} us  "
                          f"rel err {err:.1e}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
