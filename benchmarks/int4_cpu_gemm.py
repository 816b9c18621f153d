"""CPU int4 GEMMs at the default model's shapes: the kernels a packed int4 weight can take.

Usage: PYTHONPATH=. python benchmarks/int4_cpu_gemm.py --threads 1 --rows 1,8,16,64,256

Per projection of SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
the tied Q8_0 LM head 49152x576 as two int4 parts) and row count M:

* ``vnni``: ``int4_vnni.mm`` on parts in the "vnni4" layout, what every M runs on a CPU
  with AVX512-VNNI (the default);
* ``int4``: torch's ``_weight_int4pack_mm_for_cpu`` on parts in torch's layout
  (``PAGEDLLM_INT4_VNNI=0``), summed over parts;
* ``dq+bf16``: ``int4_dequant.mm`` (dequantise into a bf16 scratch, one GEMM; opt-in with
  ``PAGEDLLM_INT4_VNNI=0 PAGEDLLM_INT4_DEQUANT=1`` from 16 rows);
* ``fp32``: ``F.linear`` on a dense fp32 weight (MKL; what HF and ``quantization="none"``
  run).

Times in ms: the median CPU time of the process (robust to waiting for a core on a shared
machine, not to cache contention) and the minimum wall time, over ``--repeats`` calls.
Columns whose kernel is not available here are left out.  Not a test: nothing asserts a
time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization import int4_dequant, int4_vnni
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


def _each(parts: list[PackedInt4], x: torch.Tensor) -> list[torch.Tensor]:
    return [p.mm(x) for p in parts]


def _parts(n: int, k: int, n_parts: int, vnni: bool, gen: torch.Generator
           ) -> list[PackedInt4]:
    """Random Q4-style parts, packed in the vnni4 layout or in torch's."""
    old = os.environ.get("PAGEDLLM_INT4_VNNI")
    os.environ["PAGEDLLM_INT4_VNNI"] = "1" if vnni else "0"
    try:
        return [PackedInt4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                           torch.rand(n, k // 32, generator=gen) * 0.01,
                           torch.rand(n, k // 32, generator=gen) * 0.01, 32,
                           torch.device("cpu")) for _ in range(n_parts)]
    finally:
        if old is None:
            del os.environ["PAGEDLLM_INT4_VNNI"]
        else:
            os.environ["PAGEDLLM_INT4_VNNI"] = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PAGEDLLM_INT4_DEQUANT", "1")  # time the opt-in path too
    has_vnni, has_dq = int4_vnni.available(), int4_dequant.available()
    gen = torch.Generator().manual_seed(0)
    for name, (n, k, n_parts) in SHAPES.items():
        torch_parts = _parts(n, k, n_parts, False, gen)
        vnni_parts = _parts(n, k, n_parts, True, gen) if has_vnni else []
        w32 = torch.randn(n, k, generator=gen)
        for m in (int(r) for r in args.rows.split(",")):
            xb = torch.randn(m, k, generator=gen).bfloat16()
            x32 = xb.float()
            calls: dict[str, Callable[[], object]] = {}
            if has_vnni:
                calls["vnni"] = partial(int4_vnni.mm, x32, vnni_parts)
            calls["int4"] = partial(_each, torch_parts, xb)
            if has_dq:
                calls["dq+bf16"] = partial(int4_dequant.mm, xb, torch_parts)
            calls["fp32"] = partial(F.linear, x32, w32)
            res = {key: _time(fn, args.repeats) for key, fn in calls.items()}
            print(f"threads={args.threads} {name:8s} M={m:4d}  " + "  ".join(
                f"{key} {c:7.3f} cpu / {w:7.3f} wall" for key, (c, w) in res.items()),
                flush=True)


if __name__ == "__main__":
    main()
