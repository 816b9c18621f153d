"""A/B of the paged-attention kernel over an fp8 KV cache: K/V upcast to fp16 with the
bf16 query in fp16 (the default, ``KV_FP8 == 2``), K/V upcast to bf16 (the earlier path,
``PAGEDLLM_ATTN_FP8_F16=0``) and ``FP8_MMA`` 1 and 2 (both products on e4m3 operands),
with a bf16 cache as the yardstick.  Llama-3-8B head shape (32 query / 8 KV heads, 128 dims),
block size 16, decode batches and a prompt chunk at 2k-8k tokens of context.

    python benchmarks/fp8_attn_ab.py [--out $OUT/fp8_attn_ab.json]

Per shape: median microseconds (``triton.testing.do_bench``) of bf16 cache, fp8 cache
via fp16, via bf16, FP8_MMA 1 and 2 (``paged_attention``'s ``fp8_mma``); and the max /
mean |error| of the fp8 kernels against a dense
float32 softmax(q k^T) v over the same dequantised cache (shapes of <= 32 requests; the
bf16 kernel's error is printed as well, for scale).  Runs on a GPU only.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing

from pagedllm.attention.kv_cache_dtype import FP8_KV_DTYPE, quantize_kv
from pagedllm.kernels import paged_attention as pa
from pagedllm.kernels.paged_attention import paged_attention

HEADS, KV_HEADS, DIM, BS = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.05, 0.02  # as calculate_kv_scales would pick for |k| ~ 10, |v| ~ 2


DEV = "cuda"


def make_case(q_lens: list[int], ctx: list[int], gen: torch.Generator) -> dict:
    """A batch whose request r has ``q_lens[r]`` new tokens at the end of ``ctx[r]``."""
    dev = DEV
    seq = list(ctx)
    nblk = [math.ceil(s / BS) for s in seq]
    total = sum(nblk) + 1
    perm = torch.randperm(total - 1) + 1  # block 0 stays the null block
    tables = torch.zeros((len(seq), max(nblk)), dtype=torch.int32)
    at = 0
    for r, n in enumerate(nblk):
        tables[r, :n] = perm[at:at + n]
        at += n
    fp8 = torch.empty((2, total, BS, KV_HEADS, DIM), dtype=FP8_KV_DTYPE, device=dev)
    bf16 = torch.empty(fp8.shape, dtype=torch.bfloat16, device=dev)
    for i, (sd, sc) in enumerate(((3.0, K_SCALE), (0.5, V_SCALE))):
        x = torch.randn(fp8.shape[1:], generator=gen, device=dev) * sd
        fp8[i] = quantize_kv(x, sc)
        bf16[i] = (fp8[i].float() * sc).to(torch.bfloat16)  # the same values, exactly
        del x
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn((int(qsl[-1]), HEADS, DIM), generator=gen, device=dev)
    return dict(q=q.to(torch.bfloat16), fp8=fp8, bf16=bf16, scales=(K_SCALE, V_SCALE),
                tables=tables.to(dev), seq=torch.tensor(seq, dtype=torch.int32).to(dev),
                qsl=qsl.to(dev), q_lens=q_lens, ctx=seq)


def dense_reference(c: dict, scale: float) -> torch.Tensor:
    """float32 causal attention per request over the dequantised cache."""
    out = torch.empty(c["q"].shape, dtype=torch.float32, device=DEV)
    g = HEADS // KV_HEADS
    ks, vs = c["scales"]
    for r, (ql, sl) in enumerate(zip(c["q_lens"], c["ctx"])):
        blocks = c["tables"][r, :math.ceil(sl / BS)].long()
        k = c["fp8"][0, blocks].float().flatten(0, 1)[:sl] * ks
        v = c["fp8"][1, blocks].float().flatten(0, 1)[:sl] * vs
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [S, H, D]
        s0 = int(c["qsl"][r])
        q = c["q"][s0:s0 + ql].float()  # [Q, H, D]
        s = torch.einsum("qhd,shd->hqs", q, k) * scale
        pos = torch.arange(sl - ql, sl, device=DEV)[:, None]
        s = s.masked_fill(torch.arange(sl, device=DEV)[None, :] > pos, float("-inf"))
        out[s0:s0 + ql] = torch.einsum("hqs,shd->qhd", s.softmax(-1), v)
    return out


def run(c: dict, cache: torch.Tensor, mma: int, scale: float,
        f16: bool = True) -> torch.Tensor:
    fp8 = cache.dtype == FP8_KV_DTYPE
    pa._FP8_F16 = f16
    return paged_attention(c["q"], cache, c["tables"], c["seq"], c["qsl"],
                           num_reqs=len(c["q_lens"]), max_query_len=max(c["q_lens"]),
                           scale=scale, k_scale=K_SCALE if fp8 else 1.0,
                           v_scale=V_SCALE if fp8 else 1.0, fp8_mma=mma)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="Tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the "
                         "script runs; times mean nothing).")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
    gen = torch.Generator(device=DEV).manual_seed(0)
    scale = DIM ** -0.5
    shapes = {}
    for ctx in ((40,) if args.smoke else (2048, 4096, 8192)):
        for b in ((2,) if args.smoke else (1, 32, 128)):
            shapes[f"decode b{b} ctx{ctx}"] = ([1] * b, [ctx] * b)
        chunk = 8 if args.smoke else 512
        shapes[f"chunk {chunk} + 16 decodes ctx{ctx}"] = ([chunk] + [1] * 16, [ctx] * 17)
    rows = []
    labels = ("bf16", "fp8", "fp8bf16", "fp8mma", "fp8mma2")
    print(f"{'shape':<34}" + "".join(f"{v + ' us':>12}" for v in labels)
          + "".join(f"{'err ' + v:>14}" for v in labels) + "  (max |err|; mean in the JSON)")
    for name, (q_lens, ctx) in shapes.items():
        c = make_case(q_lens, ctx, gen)
        row: dict = {"shape": name}
        variants = (("bf16", c["bf16"], 0, True), ("fp8", c["fp8"], 0, True),
                    ("fp8bf16", c["fp8"], 0, False), ("fp8mma", c["fp8"], 1, True),
                    ("fp8mma2", c["fp8"], 2, True))
        for label, cache, mma, f16 in variants:
            try:  # a variant that fails to compile is reported, not fatal
                row[f"{label}_us"] = 0.0 if args.smoke else triton.testing.do_bench(
                    lambda c=c, cache=cache, mma=mma, f16=f16: run(c, cache, mma, scale,
                                                                   f16),
                    warmup=50, rep=300) * 1e3
            except Exception as e:  # noqa: BLE001
                row[f"{label}_us"] = float("nan")
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name} {label}: {row[f'{label}_error']}", flush=True)
        if len(q_lens) <= 32:
            ref = dense_reference(c, scale)
            for label, cache, mma, f16 in variants:
                if f"{label}_error" in row:
                    continue
                err = (run(c, cache, mma, scale, f16).float() - ref).abs()
                row[f"{label}_max_err"] = err.max().item()
                row[f"{label}_mean_err"] = err.mean().item()
            row["ref_mean_abs"] = ref.abs().mean().item()
        pa._FP8_F16 = True
        rows.append(row)
        print(f"{name:<34}" + "".join(f"{row[v + '_us']:>12.1f}" for v in labels)
              + "".join(f"{row[v + '_max_err']:>14.4f}" if v + "_max_err" in row
                        else f"{'-':>14}" for v in labels), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": DEV if args.smoke else torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
