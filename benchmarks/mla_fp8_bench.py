"""DeepSeek kernels on the GPU: the latent-space MLA decode (``kernels/mla_decode.py``) and
the block-scaled FP8 GEMM (``kernels/fp8_block_gemm.py``), each checked against its torch
reference before it is timed.

Usage (on the H200)::

    python benchmarks/mla_fp8_bench.py                    # both sections, default plans
    python benchmarks/mla_fp8_bench.py --sections mla --sweep
    python benchmarks/mla_fp8_bench.py --sections mla --kv-cache-dtype fp8   # e4m3 cache
    python benchmarks/mla_fp8_bench.py --sections mla --sweep --batch 256 --context 1536 \
        --context-min 128                               # W1-like ragged contexts
    python benchmarks/mla_fp8_bench.py --sections mla --batch 142 --context 1536 \
        --context-min 128 --chunk 370 --sweep           # a W1 chunk graph's step
    python benchmarks/mla_fp8_bench.py --sections fp8 --sweep --ms 1 32 128
    TRITON_INTERPRET=1 python benchmarks/mla_fp8_bench.py --smoke   # CPU: checks only

``mla``: decode at ``--batch`` (64) x ``--context`` (4096) on DeepSeek-V2-Lite's shape
(16 heads, kv_lora_rank 512, qk_rope_head_dim 64, block_size 16, bf16), block tables a
random permutation of the pool.  Achieved bandwidth counts the latent cache's bytes
(``sum(seq_lens) * 576 * 2``) plus queries and outputs, over the CUDA-graph replay
time; the issue's target is >= 70% of 4.2 TB/s.  ``--context-min`` makes the contexts
ragged (uniform from it to ``--context``): with one program per request (the plan's
choice at 132+ requests) the longest context sets the time.  ``--sweep`` times a grid of launch
plans (tile, splits, warps, stages) and prints the best.  ``--chunk N``: a chunk CUDA
graph's step instead (the decodes plus one request's N prompt tokens, padded to
``--graph-tokens`` rows and ``--slots`` requests) under the default plan (one query a
program; ``--sweep``: query tiles of 1, 2 and 4); bandwidth there counts the contexts'
bytes once.  ``--kv-cache-dtype fp8``: the
same cache rounded to e4m3 (scale 1.0; 576 bytes a token), checked against the oracle
over the same fp8 entries, and its plans (``plan_mla_decode(kv_fp8=True)``).

``fp8``: the block GEMM (group quantiser timed separately) at DeepSeek-V3, V2-Lite and
Llama-3-8B weight shapes for each ``--ms``, in TFLOP/s (and weight GB/s: small M is
bandwidth-bound), beside bf16 ``F.linear`` and cuBLASLt's row-wise ``torch._scaled_mm``
(what block checkpoints ran before: scales folded per channel).  Small-M calls replay
over enough weight copies to stream from HBM, not L2.  ``--sweep`` also times a grid of
configurations per shape and prints the best (for ``default_block_config``).

Results: printed, and as JSON in ``$OUT/mla_fp8_bench.json`` (``$OUT`` default
``/tmp/out``).  Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.kernels.fp8_block_gemm import (
    default_block_config,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    quantize_fp8_groups,
    quantize_fp8_groups_ref,
)
from pagedllm.kernels.mla_decode import MlaLaunch, mla_decode, mla_decode_ref, plan_mla_decode

F8 = torch.float8_e4m3fn
HBM_TBPS = 4.2  # the reference bandwidth for the H200

# (name, n, k): weight shapes [N, K] of the linears a block-FP8 checkpoint runs.
GEMM_SHAPES = {
    "deepseek-v3": [("q_a+kv_a", 2112, 7168), ("q_b", 24576, 1536), ("kv_b", 32768, 512),
                    ("o_proj", 7168, 16384), ("dense gate_up", 36864, 7168),
                    ("dense down", 7168, 18432), ("shared gate_up", 4096, 7168)],
    "deepseek-v2-lite": [("q_proj", 3072, 2048), ("kv_a", 576, 2048), ("kv_b", 4096, 512),
                         ("o_proj", 2048, 2048), ("dense gate_up", 21888, 2048),
                         ("dense down", 2048, 10944)],
    "llama3-8b": [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336)],
}


def _on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _time(calls: list[Callable[[], Any]]) -> float | None:
    """Median microseconds per call (CUDA-graph replay of every call once), or None off
    the GPU."""
    if not _on_gpu():
        return None
    from gpu_timing import graph_us

    return graph_us(calls)


# --------------------------------------------------------------------------- MLA


def mla_inputs(batch: int, context: int, heads: int, lat: int, rope: int, bs: int,
               device: str, seed: int = 0,
               context_min: int | None = None) -> tuple[torch.Tensor, ...]:
    """One decode token per request; contexts all ``context`` long, or (``context_min``)
    drawn uniformly from ``[context_min, context]`` (a W1 step: requests at every
    stage, the longest setting a one-wave launch's time)."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = -(-context // bs)
    nb = batch * per
    kv = torch.randn(1, nb, bs, 1, lat + rope, generator=g, device=device,
                     dtype=torch.bfloat16)
    tables = torch.randperm(nb, generator=g, device=device).view(batch, per).to(torch.int32)
    q_lat = torch.randn(batch, heads, lat, generator=g, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, rope, generator=g, device=device, dtype=torch.bfloat16)
    if context_min is None:
        seq = torch.full((batch,), context, dtype=torch.int32, device=device)
    else:
        seq = torch.randint(context_min, context + 1, (batch,), generator=g, device=device,
                            dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q_lat, q_pe, kv, tables, seq, qsl


def add_chunk(inputs: tuple[torch.Tensor, ...], chunk: int, prior: int, slots: int,
              graph_tokens: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """A chunk graph's step: the decodes of ``inputs``, then one request computing
    ``chunk`` prompt tokens over ``prior`` cached ones, padded as the runner pads a
    chunk graph (``graph_tokens`` query rows, ``slots`` requests; the padding requests
    have no tokens and no context)."""
    q_lat, q_pe, kv, tables, seq, qsl = inputs
    dev, batch = kv.device, seq.shape[0]
    if batch + 1 > slots or batch + chunk > graph_tokens:
        raise SystemExit(f"--chunk: {batch} decodes + {chunk} tokens do not fit "
                         f"{slots} slots / {graph_tokens} graph tokens")
    g = torch.Generator(device=dev).manual_seed(seed)
    bs = kv.shape[2]
    need = -(-(chunk + prior) // bs)
    extra = torch.randn(1, need, *kv.shape[2:], generator=g, device=dev,
                        dtype=torch.bfloat16).to(kv.dtype)  # e4m3 holds N(0, 1) as is
    kv = torch.cat([kv, extra], dim=1)
    width = max(tables.shape[1], need)
    t = torch.zeros(slots, width, dtype=torch.int32, device=dev)
    t[:batch, :tables.shape[1]] = tables
    t[batch, :need] = torch.arange(kv.shape[1] - need, kv.shape[1], device=dev)
    s = torch.zeros(slots, dtype=torch.int32, device=dev)
    s[:batch] = seq
    s[batch] = chunk + prior
    q = torch.full((slots + 1,), batch + chunk, dtype=torch.int32, device=dev)
    q[:batch + 1] = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    heads, lat, rope = q_lat.shape[1], q_lat.shape[2], q_pe.shape[2]
    ql = torch.randn(graph_tokens, heads, lat, generator=g, device=dev, dtype=q_lat.dtype)
    qp = torch.randn(graph_tokens, heads, rope, generator=g, device=dev, dtype=q_pe.dtype)
    return ql, qp, kv, t, s, q


def bench_mla(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    heads, lat, rope, bs = args.heads, 512, 64, 16
    if args.smoke:
        lat, rope = 64, 16
    inputs = mla_inputs(args.batch, args.context, heads, lat, rope, bs, device,
                        context_min=args.context_min)
    fp8 = args.kv_cache_dtype == "fp8"
    if fp8:
        from pagedllm.attention.kv_cache_dtype import quantize_kv

        inputs = (*inputs[:2], quantize_kv(inputs[2], 1.0), *inputs[3:])
    scale = (128 + rope) ** -0.5
    mql, reqs = 1, args.batch
    if args.chunk:
        inputs = add_chunk(inputs, args.chunk, args.chunk_prior, args.slots,
                           args.graph_tokens)
        mql, reqs = args.graph_tokens, args.slots
    q_lat, q_pe, kv, tables, seq, qsl = inputs
    tokens = int(qsl[-1])
    # Bytes a decode must move: every context token's latent row once, q and out.
    nbytes = (int(seq.sum()) * (lat + rope) * kv.element_size()
              + (2 * q_lat.numel() + q_pe.numel()) * 2)
    # Check a slice of the batch against the oracle (the whole batch at 4k on the GPU is
    # fine too, but the reference is a python loop), and the chunk.
    ref_reqs = list(range(min(args.batch, 8))) + ([args.batch] if args.chunk else [])
    ref_rows = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in ref_reqs])
    ref = torch.cat([mla_decode_ref(
        q_lat[int(qsl[r]):int(qsl[r + 1])], q_pe[int(qsl[r]):int(qsl[r + 1])], kv,
        tables[r:r + 1], seq[r:r + 1], (qsl[r:r + 2] - qsl[r]).contiguous(), scale)
        for r in ref_reqs]).float()
    base = plan_mla_decode(num_reqs=reqs, max_query_len=mql, num_heads=heads,
                           kv_lora_rank=lat, kv_fp8=fp8)
    plans = [base]
    if args.chunk and args.sweep:
        for bq, sp, w in itertools.product((1, 2, 4), (1, 2, 4), (4, 8)):
            plans.append(MlaLaunch(block_h=base.block_h, block_q=bq, block_n=base.block_n,
                                   num_splits=sp, num_warps=w))
    elif args.sweep:
        for bn, sp, w, st in itertools.product((16, 32, 64), (1, 2, 4, 8, 16), (4, 8),
                                               (2, 3)):
            plans.append(MlaLaunch(block_h=plans[0].block_h, block_q=1, block_n=bn,
                                    num_splits=sp, num_warps=w, num_stages=st))
    rows = []
    for i, plan in enumerate(plans):
        call = functools.partial(mla_decode, *inputs, scale, mql, launch=plan)
        try:
            out = call()
        except Exception as e:  # noqa: BLE001  (a sweep point out of resources)
            print(f"mla {plan}: {type(e).__name__}: {str(e)[:120]}")
            continue
        err = float((out[ref_rows].float() - ref).abs().max())
        ok = err < 2e-2 * max(1.0, float(ref.abs().max()))
        us = _time([call]) if ok else None
        row = {"section": "mla", "default": i == 0, "plan": plan.__dict__,
               "kv_cache_dtype": args.kv_cache_dtype,
               "batch": args.batch, "context": args.context,
               "context_min": args.context_min, "heads": heads, "chunk": args.chunk,
               "chunk_prior": args.chunk_prior, "tokens": tokens,
               "max_abs_err": err, "ok": ok, "us": us,
               "GBps": None if us is None else nbytes / us / 1e3}
        if us is not None:
            row["pct_of_4.2TBps"] = 100 * row["GBps"] / (HBM_TBPS * 1e3)
        rows.append(row)
        if i == 0 or args.verbose:  # the default plan
            _print_mla(row)
    timed = [r for r in rows if r["us"] is not None]
    if args.sweep and timed:
        print("mla best:")
        _print_mla(min(timed, key=lambda r: r["us"]))
    return rows


def _print_mla(r: dict[str, Any]) -> None:
    p = r["plan"]
    t = "untimed" if r["us"] is None else (f"{r['us']:8.1f} us {r['GBps']:7.0f} GB/s "
                                           f"({r['pct_of_4.2TBps']:.0f}% of 4.2 TB/s)")
    ctx = r["context"] if r["context_min"] is None else f"{r['context_min']}..{r['context']}"
    chunk = f" + chunk {r['chunk']} over {r['chunk_prior']}" if r["chunk"] else ""
    print(f"mla {r['kv_cache_dtype']} b{r['batch']} x {ctx}{chunk} H{r['heads']} "
          f"block_h {p['block_h']} block_q {p['block_q']} block_n {p['block_n']} "
          f"splits {p['num_splits']} warps {p['num_warps']} stages {p['num_stages']}: "
          f"{t}  err {r['max_abs_err']:.2e} {'ok' if r['ok'] else 'WRONG'}")


# --------------------------------------------------------------------------- FP8 GEMM


def _copies(n: int, k: int, m: int) -> int:
    """Weight copies per timed call so that small-M calls stream from HBM (> 2 x L2)."""
    return 1 if m >= 512 else max(1, min(16, -(-120 * 2**20 // (n * k))))


def gemm_operands(m: int, n: int, k: int, device: str, copies: int, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
    ws = [(torch.randn(n, k, generator=g, device=device) * 64).clamp(-448, 448).to(F8)
          for _ in range(copies)]
    w_s = torch.rand(-(-n // 128), -(-k // 128), generator=g, device=device) * 1e-3 + 1e-4
    return x, ws, w_s


def gemm_configs(m: int) -> list[tuple[int, int, int, int, int, int]]:
    bms = (16, 32, 64) if m <= 64 else (64, 128)
    out = []
    for bm, bn, w, st, sp in itertools.product(bms, (64, 128), (4, 8), (3, 4),
                                               (1, 2, 4, 8)):
        if m > 64 and sp > 2:
            continue
        out.append((bm, bn, w, st, sp, 1 if m <= 64 else 0))
    return out


def bench_fp8(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    shapes = [("smoke", 96, 300)] if args.smoke else [
        (f"{model} {name}", n, k) for model in args.models for name, n, k in GEMM_SHAPES[model]]
    rows = []
    for (name, n, k), m in itertools.product(shapes, args.ms):
        copies = 1 if args.smoke else _copies(n, k, m)
        x, ws, w_s = gemm_operands(m, n, k, device, copies)
        x_q, x_s = quantize_fp8_groups(x)
        ref_q, ref_s = quantize_fp8_groups_ref(x, 128)
        quant_ok = torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8)) \
            and torch.equal(x_s, ref_s)
        ref = fp8_block_gemm_ref(x_q, x_s, ws[0], w_s, (128, 128), None, torch.float32)
        cfgs = [default_block_config(m, n, k)] + (gemm_configs(m) if args.sweep else [])
        flops = 2.0 * m * n * k
        base = {"section": "fp8", "shape": name, "m": m, "n": n, "k": k,
                "quant_exact": quant_ok,
                "quant_us": _time([functools.partial(quantize_fp8_groups, x)])}
        if _on_gpu():  # the baselines: bf16 cuBLAS, and the per-channel FP8 GEMM
            wb = [w.to(torch.bfloat16) for w in ws]
            base["bf16_us"] = _time([functools.partial(torch.nn.functional.linear, x, w)
                                     for w in wb])
            del wb
            # Only timing: unit row-wise scales (the folded path's kernel, cuBLASLt).
            sa = torch.ones(m, 1, device=device)
            sb = torch.ones(1, n, device=device)
            try:
                base["rowwise_scaled_mm_us"] = _time([functools.partial(
                    torch._scaled_mm, x_q, w.t(), scale_a=sa, scale_b=sb,
                    out_dtype=torch.bfloat16) for w in ws])
            except RuntimeError as e:
                print(f"  _scaled_mm at {(m, n, k)}: {str(e)[:100]}")
                base["rowwise_scaled_mm_us"] = float("nan")
        best = None
        for i, cfg in enumerate(cfgs):
            try:
                got = fp8_block_gemm(x_q, x_s, ws[0], w_s, (128, 128), None,
                                     torch.bfloat16, cfg).float()
            except Exception as e:  # noqa: BLE001  (a sweep point out of resources)
                if args.verbose:
                    print(f"fp8 {name} m={m} {cfg}: {type(e).__name__}")
                continue
            err = float(((got - ref).abs() / (ref.abs() + ref.abs().mean())).max())
            ok = err < 1e-2  # bf16 output rounding
            us = _time([functools.partial(fp8_block_gemm, x_q, x_s, w, w_s, (128, 128),
                                          None, torch.bfloat16, cfg) for w in ws]) if ok \
                else None
            row = {**base, "config": list(cfg), "default": i == 0, "rel_err": err,
                   "ok": ok, "us": us,
                   "TFLOPs": None if us is None else flops / us / 1e6,
                   "weight_GBps": None if us is None else n * k / us / 1e3}
            rows.append(row)
            if i == 0 or args.verbose:
                _print_fp8(row)
            if us is not None and (best is None or us < best["us"]):
                best = row
        if args.sweep and best is not None:
            print("  best:", end=" ")
            _print_fp8(best)
        del ws
    return rows


def _print_fp8(r: dict[str, Any]) -> None:
    t = "untimed" if r["us"] is None else (f"{r['us']:8.1f} us {r['TFLOPs']:6.1f} TFLOP/s "
                                           f"{r['weight_GBps']:6.0f} GB/s(w)")
    extra = ""
    if r.get("bf16_us"):
        extra = (f" | quant {r['quant_us']:.1f} us, bf16 {r['bf16_us']:.1f} us, "
                 f"rowwise fp8 {r['rowwise_scaled_mm_us']:.1f} us")
    print(f"fp8 {r['shape']:26s} M={r['m']:5d} N={r['n']:5d} K={r['k']:5d} "
          f"{tuple(r['config'])}: {t} err {r['rel_err']:.1e} "
          f"{'ok' if r['ok'] and r['quant_exact'] else 'WRONG'}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=["mla", "fp8"], choices=["mla", "fp8"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--context-min", type=int, default=None,
                    help="ragged contexts, uniform in [this, --context] (W1-like: "
                         "--batch 256 --context 1536 --context-min 128)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="MLA: a chunk graph's step instead of a decode step -- the "
                         "--batch decodes plus one request computing this many prompt "
                         "tokens (W1-like: --batch 142 --context 1536 --context-min 128 "
                         "--chunk 370), timed with the default plan (--sweep: a grid "
                         "of query tiles, splits and warps)")
    ap.add_argument("--chunk-prior", type=int, default=0,
                    help="--chunk: cached tokens before the chunk")
    ap.add_argument("--graph-tokens", type=int, default=512,
                    help="--chunk: the chunk graph's token count (its max_query_len)")
    ap.add_argument("--slots", type=int, default=256,
                    help="--chunk: the chunk graph's request slots (max_num_seqs)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the MLA section's latent cache: bf16 (auto) or e4m3")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32, 128, 1024, 4096])
    ap.add_argument("--models", nargs="+", default=list(GEMM_SHAPES), choices=list(GEMM_SHAPES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, checks only (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.context, args.heads, args.ms = 3, 40, 4, [1, 37]
    device = "cuda" if _on_gpu() else "cpu"
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        print("no GPU: correctness checks only, timing skipped")
    rows: list[dict[str, Any]] = []
    if "mla" in args.sections:
        rows += bench_mla(args, device)
    if "fp8" in args.sections:
        rows += bench_fp8(args, device)
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "mla_fp8_bench.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["ok"] or not r.get("quant_exact", True)]
    print(f"wrote {path}; {len(bad)} wrong result(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
