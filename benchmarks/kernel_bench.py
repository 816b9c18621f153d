"""GPU microbenchmark of the Triton kernels at Llama-3-8B shapes.

    python benchmarks/kernel_bench.py --out kernels.json [--quick] [--sweep]

Sections (each checks correctness before timing, and records the error):

* decode: paged attention, 32 q heads / 8 KV heads / head 128 / block 16, bf16, batch
  1..256 x context 512..8k, scattered block tables; vs ``torch SDPA`` on contiguous
  ``[B, 8, ctx, 128]`` K/V (``enable_gqa``) and ``flash_attn_with_kvcache`` when
  importable.  Reports microseconds and the achieved KV read bandwidth.
* mixed: prefill chunks (with cached context) + decodes in one launch vs per-request
  SDPA with a bottom-right causal mask, and ``flash_attn_varlen_func`` when importable.
* elementwise: KV write, fused add+RMSNorm, rotary, SiLU-and-mul, sampling vs eager torch.
* quant (``--sections quant``): INT4/INT8 weight GEMMs (W4A16 group 128, W8A8-INT8) at
  the Llama-3-8B projections vs bf16, with the weight-read floor
  (``benchmarks/quant_gemm_bench.py``).
* sweep (``--sweep``): launch-plan grid (tile_n, warps, stages, splits) on a few decode
  and prefill shapes, to retune ``plan_attention``'s defaults.

Timing: ``triton.testing.do_bench`` (median; it flushes L2 between runs, so small
caches are not served from the 50 MB L2 -- as in a real model where every layer reads
its own cache).  Medians are in microseconds.  Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
COPY_CEILING_GBS = 4230.0  # measured device copy (read+write) on the H200, BENCHMARKS.md


def _bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3


def _try_import(name: str) -> Any:
    try:
        return __import__(name, fromlist=["_"])
    except Exception:  # noqa: BLE001 - any import failure just means "peer absent"
        return None


class PagedSetup:
    """A random bf16 KV cache big enough for the largest decode batch, and per-config
    scattered block tables drawn from it."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.num_blocks = max_tokens // BLOCK_SIZE + 64
        self.kv_cache = torch.randn(2, self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                    device=device, dtype=DTYPE)

    def batch(self, q_lens: list[int], seq_lens: list[int]) -> dict[str, Any]:
        blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
        ids = torch.randperm(self.num_blocks, device=self.device)[:sum(blocks)]
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32,
                             device=self.device)
        off = 0
        for r, n in enumerate(blocks):
            tables[r, :n] = ids[off:off + n].to(torch.int32)
            off += n
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        return dict(
            query=torch.randn(qsl[-1], NUM_HEADS, HEAD_DIM, device=self.device, dtype=DTYPE),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            q_lens=q_lens, seq_lens_list=seq_lens)

    def dense_kv(self, b: dict[str, Any], r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's K/V as contiguous ``[KVH, S, D]``."""
        s = b["seq_lens_list"][r]
        pos = torch.arange(s, device=self.device)
        blk = b["block_tables"][r].long()[pos // BLOCK_SIZE]
        k = self.kv_cache[0, blk, pos % BLOCK_SIZE].transpose(0, 1)
        v = self.kv_cache[1, blk, pos % BLOCK_SIZE].transpose(0, 1)
        return k.contiguous(), v.contiguous()


def _run_paged(b: dict[str, Any], cache: torch.Tensor, **kw: Any) -> torch.Tensor:
    from pagedllm.kernels.paged_attention import paged_attention

    return paged_attention(
        b["query"], cache, b["block_tables"], b["seq_lens"], b["query_start_loc"],
        num_reqs=len(b["q_lens"]), max_query_len=max(b["q_lens"]),
        scale=HEAD_DIM ** -0.5, **kw)


def _sdpa_per_request(setup: PagedSetup, b: dict[str, Any]) -> tuple[Callable[[], Any],
                                                                       torch.Tensor]:
    """Per-request SDPA on contiguous K/V with a bottom-right causal mask; returns the
    timed closure and its output (flattened like the paged output)."""
    items = []
    start = 0
    for r, q_len in enumerate(b["q_lens"]):
        k, v = setup.dense_kv(b, r)
        s = k.shape[1]
        q = b["query"][start:start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        mask = None
        if q_len > 1:
            qpos = torch.arange(s - q_len, s, device=setup.device)[:, None]
            mask = torch.arange(s, device=setup.device)[None, :] <= qpos
        items.append((q, k.unsqueeze(0), v.unsqueeze(0), mask))
        start += q_len

    def run() -> list[torch.Tensor]:
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
                for q, k, v, m in items]

    out = torch.cat([o[0].transpose(0, 1) for o in run()])
    return run, out


def bench_decode(setup: PagedSetup, batches: list[int], ctxs: list[int]) -> list[dict]:
    fa = _try_import("flash_attn")
    rows = []
    for bs in batches:
        for ctx in ctxs:
            b = setup.batch([1] * bs, [ctx] * bs)
            cache = setup.kv_cache
            out = _run_paged(b, cache)
            # Contiguous K/V for the peers: [B, KVH, ctx, D].
            kv = [setup.dense_kv(b, r) for r in range(bs)]
            k = torch.stack([x[0] for x in kv])
            v = torch.stack([x[1] for x in kv])
            del kv
            q = b["query"].unsqueeze(2)  # [B, H, 1, D]
            ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).squeeze(2)
            err = (out.float() - ref.float()).abs().max().item()
            kv_bytes = 2 * bs * ctx * NUM_KV_HEADS * HEAD_DIM * 2
            row: dict[str, Any] = dict(batch=bs, ctx=ctx, max_abs_err=err)
            t_auto = _bench(partial(_run_paged, b, cache))
            t_one = _bench(partial(_run_paged, b, cache, num_splits=1))
            t_sdpa = _bench(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))
            row.update(paged_auto_us=t_auto, paged_nosplit_us=t_one, sdpa_us=t_sdpa,
                       paged_auto_GBs=kv_bytes / t_auto / 1e3,
                       sdpa_GBs=kv_bytes / t_sdpa / 1e3)
            if fa is not None:
                kc = k.transpose(1, 2).contiguous()  # [B, ctx, KVH, D]
                vc = v.transpose(1, 2).contiguous()
                qf = b["query"].unsqueeze(1)  # [B, 1, H, D]
                lens = torch.full((bs,), ctx, dtype=torch.int32, device=setup.device)
                row["flash_attn_us"] = _bench(partial(
                    fa.flash_attn_with_kvcache, qf, kc, vc, cache_seqlens=lens, causal=True))
                del kc, vc
            rows.append(row)
            _print_row(row)
            del k, v, ref
    return rows


def _mixed_cases() -> dict[str, tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) per named case."""
    chunks_q = [512] * 4
    chunks_s = [512, 512 + 1024, 512 + 2048, 512 + 4096]
    return {
        "prefill_2048": ([2048], [2048]),
        "8x_prompt_1024": ([1024] * 8, [1024] * 8),
        "4_chunks_ctx_+64_decodes": (chunks_q + [1] * 64, chunks_s + [2048] * 64),
        "chunk_8k_ctx_+128_decodes": ([2048] + [1] * 128, [8192] + [1024] * 128),
    }


def bench_mixed(setup: PagedSetup) -> list[dict]:
    fa = _try_import("flash_attn")
    rows = []
    for name, (q_lens, seq_lens) in _mixed_cases().items():
        b = setup.batch(q_lens, seq_lens)
        out = _run_paged(b, setup.kv_cache)
        run_sdpa, ref = _sdpa_per_request(setup, b)
        err = (out.float() - ref.float()).abs().max().item()
        # Causal FLOPs: 4 * H * D per (query, visible key) pair.
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
        flops = 4 * NUM_HEADS * HEAD_DIM * pairs
        t = _bench(partial(_run_paged, b, setup.kv_cache))
        t_sdpa = _bench(run_sdpa)
        row: dict[str, Any] = dict(case=name, tokens=sum(q_lens), max_abs_err=err,
                                   paged_us=t, sdpa_loop_us=t_sdpa,
                                   paged_TFLOPs=flops / t / 1e6,
                                   sdpa_TFLOPs=flops / t_sdpa / 1e6)
        if fa is not None:
            ks, vs = zip(*[setup.dense_kv(b, r) for r in range(len(q_lens))])
            kf = torch.cat([k.transpose(0, 1) for k in ks]).contiguous()
            vf = torch.cat([v.transpose(0, 1) for v in vs]).contiguous()
            cu_k = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32,
                                device=setup.device)
            row["flash_attn_varlen_us"] = _bench(partial(
                fa.flash_attn_varlen_func, b["query"], kf, vf, b["query_start_loc"], cu_k,
                max(q_lens), max(seq_lens), causal=True))
        rows.append(row)
        _print_row(row)
    return rows


def _elementwise_entries(t: int, device: torch.device, cos_sin: torch.Tensor
                         ) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """(ours, eager torch peer or None) per op at ``t`` tokens of Llama-3-8B sizes."""
    from pagedllm.kernels.activation import silu_and_mul
    from pagedllm.kernels.kv_write import write_kv_cache
    from pagedllm.kernels.norm import fused_add_rms_norm
    from pagedllm.kernels.rotary import apply_rotary
    from pagedllm.kernels.sampling import sample_tokens

    hidden, inter, vocab = 4096, 14336, 128256
    x = torch.randn(t, hidden, device=device, dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=device, dtype=DTYPE)

    def torch_norm() -> torch.Tensor:
        h = (x + res).float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE)

    g = torch.randn(t, 2 * inter, device=device, dtype=DTYPE)
    pos = torch.randint(0, 8192, (t,), device=device)
    q = torch.randn(t, NUM_HEADS * HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(t, NUM_KV_HEADS * HEAD_DIM, device=device, dtype=DTYPE)
    cache = torch.zeros(2, t // BLOCK_SIZE + 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                        device=device, dtype=DTYPE)
    slots = torch.randperm(cache.shape[1] * BLOCK_SIZE, device=device)[:t]
    kv = k.view(t, NUM_KV_HEADS, HEAD_DIM)
    flat_cache = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    entries: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
        "fused_add_rms_norm": (partial(fused_add_rms_norm, x, res, w, 1e-5), torch_norm),
        "silu_and_mul": (partial(silu_and_mul, g),
                         lambda: F.silu(g[:, :inter]) * g[:, inter:]),
        "rotary_q_k": (partial(apply_rotary, pos, q, k, HEAD_DIM, cos_sin), None),
        "kv_write": (partial(write_kv_cache, kv, kv, cache, slots),
                     lambda: flat_cache.index_copy_(1, slots, torch.stack([kv, kv]))),
    }
    if t <= 256:
        logits = torch.randn(t, vocab, device=device, dtype=torch.float32)
        temp = torch.full((t,), 0.8, device=device)
        seeds = torch.arange(t, device=device)
        topp = torch.full((t,), 0.9, device=device)
        entries["sample_random"] = (
            partial(sample_tokens, logits, temp, seeds, seeds),
            lambda: (logits / temp[:, None]).softmax(-1).div(
                torch.empty_like(logits).exponential_()).argmax(-1))
        entries["sample_top_p"] = (
            partial(sample_tokens, logits, temp, seeds, seeds, top_p=topp), None)
        entries["greedy"] = (partial(sample_tokens, logits, None),
                             partial(torch.argmax, logits, -1))
    return entries


def bench_elementwise(device: torch.device) -> list[dict]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float()
                                   / HEAD_DIM))
    freqs = torch.arange(8192, device=device).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    rows = []
    for t in (1, 64, 256, 8192):
        for name, (ours, peer) in _elementwise_entries(t, device, cos_sin).items():
            row: dict[str, Any] = dict(op=name, tokens=t, triton_us=_bench(ours))
            if peer is not None:
                row["torch_us"] = _bench(peer)
            rows.append(row)
            _print_row(row)
    return rows


def bench_sweep(setup: PagedSetup) -> list[dict]:
    """Time a grid of launch plans on representative shapes (compiles each variant)."""
    from pagedllm.kernels.paged_attention import AttentionLaunch, plan_attention

    shapes = {"decode_b1_8k": ([1], [8192]), "decode_b32_2k": ([1] * 32, [2048] * 32),
              "decode_b256_1k": ([1] * 256, [1024] * 256),
              "prefill_2048": ([2048], [2048]),
              "mixed": ([512] * 4 + [1] * 64, [1024, 2048, 3072, 4096] + [2048] * 64)}
    rows = []
    for name, (q_lens, seq_lens) in shapes.items():
        b = setup.batch(q_lens, seq_lens)
        ref = _run_paged(b, setup.kv_cache, num_splits=1)
        base = plan_attention(num_reqs=len(q_lens), max_query_len=max(q_lens),
                              num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                              block_size=BLOCK_SIZE, sm_count=_sms(setup.device))
        decode = max(q_lens) == 1
        # num_splits is a runtime kernel argument: only the other knobs compile variants.
        block_ms = [16] if decode else [32, 64, 128]
        tile_ns = (16, 32, 64, 128) if decode else (32, 64, 128)
        splits = sorted({1, base.num_splits, 4, 8, 16, 32}) if decode else [1]
        for block_m in block_ms:
            for tile_n in tile_ns:
                for warps in ((2, 4, 8) if decode else (4, 8)):
                    for stages in (1, 2, 3):
                        for sp in splits:
                            launch = AttentionLaunch(block_m, block_m // 4, tile_n, sp,
                                                     warps, stages)
                            row: dict[str, Any] = dict(shape=name, block_m=block_m,
                                                       tile_n=tile_n, warps=warps,
                                                       stages=stages, splits=sp)
                            try:
                                out = _run_paged(b, setup.kv_cache, launch=launch)
                                row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                                row["us"] = _bench(partial(
                                    _run_paged, b, setup.kv_cache, launch=launch))
                            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                                row["error"] = repr(e)[:200]
                            rows.append(row)
        best = sorted((r for r in rows if r["shape"] == name and "us" in r),
                      key=lambda r: r["us"])[:5]
        print(f"sweep {name}: default {base}; best:")
        for r in best:
            _print_row(r)
    return rows


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_cuda_graph(setup: PagedSetup) -> dict[str, Any]:
    """Capture a decode step (split path) once, then replay it with longer contexts
    written into the same metadata tensors: the result must follow the new lengths."""
    from pagedllm.kernels.paged_attention import plan_attention

    bs = 8
    b = setup.batch([1] * bs, [4096] * bs)
    seq_lens = b["seq_lens"]
    seq_lens.fill_(100)
    plan = plan_attention(num_reqs=bs, max_query_len=1, num_heads=NUM_HEADS,
                          num_kv_heads=NUM_KV_HEADS, block_size=BLOCK_SIZE,
                          sm_count=_sms(setup.device))
    out = torch.empty_like(b["query"])
    _run_paged(b, setup.kv_cache, out=out)  # warm-up compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_paged(b, setup.kv_cache, out=out)
    seq_lens.copy_(torch.randint(3000, 4097, (bs,), device=setup.device, dtype=torch.int32))
    b["seq_lens_list"] = seq_lens.tolist()
    graph.replay()
    ref = _run_paged(b, setup.kv_cache, num_splits=1)
    err = (out.float() - ref.float()).abs().max().item()
    res = dict(num_splits=plan.num_splits, max_abs_err_after_replay=err,
               ok=bool(err < 2e-2))
    print("cuda graph replay:", res)
    return res


def _print_row(row: dict[str, Any]) -> None:
    parts = []
    for k, v in row.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print("  " + " ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true",
                    help="fewer decode shapes (and quant row counts)")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch plans")
    ap.add_argument("--sections", default="decode,mixed,elementwise,graph",
                    help="comma list of: decode, mixed, elementwise, graph, sweep, quant")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA device")
    import triton

    device = torch.device("cuda")
    torch.manual_seed(0)
    sections = set(args.sections.split(","))
    if args.sweep:
        sections.add("sweep")
    batches = [1, 8, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    ctxs = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192]
    result: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device), sms=_sms(device),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE, dtype=str(DTYPE)),
        copy_ceiling_GBs=COPY_CEILING_GBS,
        peers=dict(flash_attn=_try_import("flash_attn") is not None,
                   flashinfer=_try_import("flashinfer") is not None),
        date=time.strftime("%Y-%m-%d %H:%M:%S"))
    t0 = time.time()
    if "quant" in sections:  # first: it needs the memory the paged KV setup takes
        from quant_gemm_bench import bench_quant  # this folder (run as a script)

        print("quantised GEMMs (us; GB/s of weight + activation traffic):")
        result["quant"] = bench_quant(device, rows=(1, 16, 2048) if args.quick else
                                      (1, 16, 64, 256, 2048), print_row=_print_row)
    # The paged KV setup (GBs) only for the sections that read it.
    if sections & {"graph", "decode", "mixed", "sweep"}:
        setup = PagedSetup(max(batches) * max(ctxs) + 8192 * 2, device)
    if "graph" in sections:
        result["cuda_graph"] = check_cuda_graph(setup)
    if "decode" in sections:
        print("decode (us; GB/s of KV read):")
        result["decode"] = bench_decode(setup, batches, ctxs)
    if "mixed" in sections:
        print("mixed prefill + decode:")
        result["mixed"] = bench_mixed(setup)
    if "elementwise" in sections:
        print("elementwise:")
        result["elementwise"] = bench_elementwise(device)
    if "sweep" in sections:
        result["sweep"] = bench_sweep(setup)
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
