"""CPU int4 GEMMs at the default model's shapes: int4 kernel vs bf16-scratch path vs fp32.

Usage: PYTHONPATH=. python benchmarks/int4_cpu_gemm.py --threads 1 --rows 1,8,16,64,256

Per projection of SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
the tied Q8_0 LM head 49152x576 as two int4 parts) and row count M:

* ``int4``: torch's ``_weight_int4pack_mm_for_cpu`` (``int4pack.PackedInt4.mm``, summed
  over parts), what M < 16 runs;
* ``dq+bf16``: ``int4_dequant.mm`` (dequantise into the bf16 scratch, one GEMM), what
  M >= 16 runs;
* ``fp32``: ``F.linear`` on a dense fp32 weight (MKL; what HF and ``quantization="none"``
  run).

Times in ms: the median CPU time of the process (robust to waiting for a core on a shared
machine, not to cache contention) and the minimum wall time, over ``--repeats`` calls.
Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization import int4_dequant
from pagedllm.layers.quantization.int4pack import PackedInt4

SHAPES = {"qkv": (960, 576, 1), "o": (576, 576, 1), "gate_up": (3072, 576, 1),
          "down": (576, 1536, 1), "lm_head": (49152, 576, 2)}


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1e3, min(wall) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not int4_dequant.available():
        raise SystemExit("the int4 dequantiser is not available here (int4_dequant.py)")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k, n_parts) in SHAPES.items():
        parts = [PackedInt4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                            torch.rand(n, k // 32, generator=gen) * 0.01,
                            torch.rand(n, k // 32, generator=gen) * 0.01, 32,
                            torch.device("cpu")) for _ in range(n_parts)]
        w32 = torch.randn(n, k, generator=gen)
        for m in (int(r) for r in args.rows.split(",")):
            xb = torch.randn(m, k, generator=gen).bfloat16()
            x32 = xb.float()
            res = {
                "int4": _time(lambda xb=xb, parts=parts: [p.mm(xb) for p in parts],
                              args.repeats),
                "dq+bf16": _time(lambda xb=xb, parts=parts: int4_dequant.mm(xb, parts),
                                 args.repeats),
                "fp32": _time(lambda x32=x32, w32=w32: F.linear(x32, w32), args.repeats),
            }
            print(f"threads={args.threads} {name:8s} M={m:4d}  " + "  ".join(
                f"{key} {c:7.3f} cpu / {w:7.3f} wall" for key, (c, w) in res.items()),
                flush=True)


if __name__ == "__main__":
    main()
