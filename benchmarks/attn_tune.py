"""Time a small grid of paged-attention launch plans at one model's head shape.

    python benchmarks/attn_tune.py --heads 32 --kv-heads 8 --head-dim 128
    python benchmarks/attn_tune.py --heads 9 --kv-heads 3 --head-dim 64

Prints, per shape, the heuristic's plan and time and the five fastest variants (median
microseconds, ``triton.testing.do_bench``).  A tuning aid for ``plan_attention``; the
Llama-3-8B grid with peers lives in ``pagedllm.benchmarks.kernel_bench``.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton.testing

from pagedllm.kernels.paged_attention import AttentionLaunch, paged_attention, plan_attention


def w1_decode_shapes() -> dict[str, tuple[list[int], list[int]]]:
    """W1's decode steps at a few batch sizes: after the prompts (FCFS, all admitted),
    decode step t has every request with output_len > t, at context plen + t.  Each in
    engine order and sorted longest first (what a longest-first program order would see)."""
    from pagedllm.benchmarks.workloads import w1

    reqs = [(len(r.prompt_token_ids), r.output_len) for r in w1(256)]
    shapes: dict[str, tuple[list[int], list[int]]] = {}
    for t in (20, 150, 290, 400, 460):
        ctx = [p + t for p, o in reqs if o > t]
        shapes[f"w1_t{t}_b{len(ctx)}"] = ([1] * len(ctx), ctx)
        srt = sorted(ctx, reverse=True)
        shapes[f"w1_t{t}_b{len(ctx)}_sorted"] = ([1] * len(srt), srt)
    # The first step: whole prompts from an empty cache up to the 8,192-token budget.
    lens, used = [], 0
    for p, _ in reqs:
        lens.append(min(p, 8192 - used))
        used += lens[-1]
        if used == 8192:
            break
    shapes[f"w1_prefill_{len(lens)}x"] = (lens, lens)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--w1", action="store_true",
                    help="decode batches as W1 has them (variable contexts), each also "
                    "with its requests sorted longest first, and more stages and splits")
    a = ap.parse_args()
    dev, bs, dt = torch.device("cuda"), a.block_size, torch.bfloat16
    gqa = a.heads // a.kv_heads
    shapes = w1_decode_shapes() if a.w1 else {
              "decode_b1_4k": ([1], [4096]), "decode_b16_1k": ([1] * 16, [1024] * 16),
              "decode_b64_1k": ([1] * 64, [1024] * 64),
              "decode_b256_1k": ([1] * 256, [1024] * 256),
              "prefill_8x1k": ([1024] * 8, [1024] * 8),
              "mixed_w1": ([600] * 8 + [1] * 200, [600] * 8 + [900] * 200)}
    total = max(sum(s) for _, s in shapes.values())
    num_blocks = total // bs + 8 * len(shapes[list(shapes)[0]][1]) + 512
    cache = torch.randn(2, num_blocks, bs, a.kv_heads, a.head_dim, device=dev, dtype=dt)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for name, (q_lens, seq_lens) in shapes.items():
        blocks = [math.ceil(s / bs) for s in seq_lens]
        ids = torch.randperm(num_blocks, device=dev)[:sum(blocks)].to(torch.int32)
        tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=dev)
        off = 0
        for r, n in enumerate(blocks):
            tables[r, :n] = ids[off:off + n]
            off += n
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                           device=dev)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        q = torch.randn(int(qsl[-1]), a.heads, a.head_dim, device=dev, dtype=dt)
        decode = max(q_lens) == 1

        def run(launch: AttentionLaunch | None, q=q, tables=tables, sl=sl, qsl=qsl,
                q_lens=q_lens) -> torch.Tensor:
            return paged_attention(q, cache, tables, sl, qsl, num_reqs=len(q_lens),
                                   max_query_len=max(q_lens), scale=a.head_dim ** -0.5,
                                   launch=launch)

        base = plan_attention(num_reqs=len(q_lens), max_query_len=max(q_lens),
                              num_heads=a.heads, num_kv_heads=a.kv_heads, block_size=bs,
                              sm_count=sms)
        ref = run(AttentionLaunch(base.block_m, base.block_q, base.tile_n, 1, 4, 2)).float()
        rows = []
        block_ms = [max(16, triton.next_power_of_2(gqa))] if decode else [64, 128]
        for block_m in block_ms:
            for tile_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4) if a.w1 else (2, 3):
                        for sp in sorted({1, 2, 4} if a.w1 else {1, base.num_splits}):
                            la = AttentionLaunch(block_m, max(1, block_m // gqa), tile_n, sp,
                                                 warps, stages)
                            try:
                                err = (run(la).float() - ref).abs().max().item()
                                us = triton.testing.do_bench(lambda la=la: run(la), warmup=5,
                                                             rep=30) * 1e3
                                rows.append((us, err, la))
                            except Exception as e:  # noqa: BLE001 - e.g. shared memory
                                print(f"  {la}: {type(e).__name__}")
        base_us = triton.testing.do_bench(lambda: run(None), warmup=5, rep=30) * 1e3
        kv_bytes = sum(seq_lens) * a.kv_heads * a.head_dim * 2 * 2
        print(f"{name}: heuristic {base} {base_us:.1f} us "
              f"({kv_bytes / base_us / 1e3:.0f} GB/s of KV)")
        for us, err, la in sorted(rows, key=lambda r: r[0])[:5]:
            print(f"   {us:8.1f} us  err {err:.2g}  {la}")


if __name__ == "__main__":
    main()
