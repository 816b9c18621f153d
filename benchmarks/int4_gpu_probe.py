"""GPU probe of the GGUF int4 path (layers/quantization/int4pack.py): correctness of the
CUDA packing against the CPU reference, and the batch-1 GEMM time of W4 (group 32 and
128) against bf16 on Llama-3-8B's linear shapes.  Writes JSON to argv[1].

    python benchmarks/int4_gpu_probe.py $OUT/int4.json
"""

from __future__ import annotations

import json
import sys

import torch

from pagedllm.layers.quantization.int4pack import PackedInt4, mm_parts

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _bench(f, n: int = 200) -> float:
    for _ in range(10):
        f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n // 20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3  # us


def main() -> None:
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    # correctness: CUDA vs the dequantised reference, small shape
    n, k = 256, 512
    v = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // 32, generator=gen) * 0.01
    z = torch.randn(n, k // 32, generator=gen) * 0.01
    w = ((v.float() - 8).view(n, -1, 32) * s.unsqueeze(-1) + z.unsqueeze(-1)).view(n, k)
    x = torch.randn(3, k, generator=gen)
    ref = x.double() @ w.double().t()
    got = mm_parts(x.to(dev), [PackedInt4(v, s, z, 32, dev)]).double().cpu()
    cpu = mm_parts(x, [PackedInt4(v, s, z, 32, torch.device("cpu"))]).double()
    out["rel_err_cuda"] = float((got - ref).abs().max() / ref.abs().max())
    out["rel_err_cpu"] = float((cpu - ref).abs().max() / ref.abs().max())
    rows = {}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        r = {"bf16_us": _bench(lambda x=x, wb=wb: torch.nn.functional.linear(x, wb))}
        for g in (32, 128):
            v = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            s = torch.rand(n, k // g) * 0.01
            z = torch.zeros(n, k // g)
            p = PackedInt4(v, s, z, g, dev)
            r[f"w4g{g}_us"] = _bench(lambda p=p, x=x: p.mm(x))
        rows[name] = r
    out["gemm_batch1"] = rows
    for key in ("bf16_us", "w4g32_us", "w4g128_us"):
        out[f"per_token_32_layers_ms_{key}"] = sum(r[key] for r in rows.values()) * 32 / 1e3
    print(json.dumps(out, indent=2))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
