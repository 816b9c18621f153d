"""Where does a step's time go?  Host cProfile + CUDA kernel totals for a W1 slice.

Usage: python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 64 --out DIR
Writes host_profile.txt (cProfile by tottime) and kernels.txt (torch.profiler CUDA
kernel totals) and prints the GPU-busy fraction of the timed generate call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import dummy_config, w1, w4, write_dummy_model


def category(name: str) -> str:
    """Coarse kernel class for the summary line."""
    n = name.lower()
    if "paged_attn" in n or "mixed_attn" in n or "reduce_splits" in n:
        return "attention"
    if any(k in n for k in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "splitk", "xmma")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "quant" in n:  # the FP8 per-token activation quantiser
        return "quant"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dummy", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--scheduling-policy", default=None,
                    choices=["fcfs", "priority", "throughput"],
                    help="default: the offline LLM's (throughput)")
    ap.add_argument("--quantization", default=None,
                    help="as pagedllm's --quantization (e.g. fp8); default: none")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="as pagedllm's --kv-cache-dtype (auto or fp8)")
    ap.add_argument("--no-cprofile", action="store_true",
                    help="CUDA kernels only (cProfile slows the host ~2x, which would "
                    "understate how busy the GPU is)")
    ap.add_argument("--w4", action="store_true",
                    help="profile one W4 request (512 prompt, 256 output tokens) instead")
    ap.add_argument("--per-step", action="store_true",
                    help="also split the kernel time by engine step (steps are delimited "
                    "by the sampling kernel; their token and request counts come from "
                    "PAGEDLLM_STEP_TRACE) and print it by step kind and batch size; "
                    "writes steps.jsonl.  Turns PDL off (with PDL a kernel's duration "
                    "includes its wait for the one before)")
    a = ap.parse_args()
    trace_path = os.path.join(a.out, "step_trace.jsonl")
    if a.per_step:
        open(trace_path, "w").close()
        os.environ["PAGEDLLM_STEP_TRACE"] = trace_path
        from pagedllm.kernels import pdl  # the engine runs in this process

        pdl._capability_ok = lambda index: False  # as before Hopper: no PDL
    # Random prompt ids below the shape's vocabulary (and below Llama-3's, as W1's).
    vocab_hi = min(128000, int(dummy_config(a.dummy).get("vocab_size", 128000)) - 1)
    llm = LLM(write_dummy_model(a.dummy), load_format="dummy", skip_tokenizer_init=True,
              max_num_batched_tokens=a.max_num_batched_tokens,
              scheduling_policy=a.scheduling_policy, quantization=a.quantization,
              kv_cache_dtype=a.kv_cache_dtype)
    if a.w4:
        prompts = [w4(1, vocab_hi=vocab_hi)]
        out_lens = [256]
    else:
        reqs = w1(a.num_prompts, vocab_hi=vocab_hi)
        prompts = [r.prompt_token_ids for r in reqs]
        out_lens = [r.output_len for r in reqs]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    # Warm up on other prompts, then empty the prefix cache: only the timed run counts.
    warm = [w4(2, vocab_hi=vocab_hi)] if a.w4 else [
        r.prompt_token_ids for r in w1(4, seed=1, vocab_hi=vocab_hi)]
    llm.generate(warm, SamplingParams(temperature=0, ignore_eos=True, max_tokens=8),
                 use_tqdm=False)
    llm.reset_prefix_cache()
    warm_steps = _count_lines(trace_path) if a.per_step else 0
    pr = cProfile.Profile()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if not a.no_cprofile:
            pr.enable()
        llm.generate(prompts, params, use_tqdm=False)
        pr.disable()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    s = io.StringIO()
    if not a.no_cprofile:
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    with open(os.path.join(a.out, "host_profile.txt"), "w") as f:
        f.write(s.getvalue())
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka)
    table = ka.table(sort_by="self_device_time_total", row_limit=30)
    with open(os.path.join(a.out, "kernels.txt"), "w") as f:
        f.write(table)
    out_tokens = sum(out_lens)
    print(f"wall {wall:.2f} s (under profilers), GPU busy {gpu_us / 1e6:.2f} s = "
          f"{100 * gpu_us / 1e6 / wall:.0f}%, {out_tokens / wall:.0f} out tok/s")
    cats: dict[str, float] = {}
    for e in ka:
        if e.self_device_time_total > 0:
            c = category(e.key)
            cats[c] = cats.get(c, 0.0) + e.self_device_time_total
    print("GPU time by class: " + ", ".join(
        f"{c} {v / 1e6:.2f} s ({100 * v / max(gpu_us, 1):.0f}%)"
        for c, v in sorted(cats.items(), key=lambda kv: -kv[1])))
    print(table[:6000])
    print(s.getvalue()[:6000])
    # CUDA runtime/driver calls as the host saw them: a launch or copy that blocks (a full
    # launch queue, a pageable copy, an allocator sync) shows as a long host time here.
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12)[:4000])
    if a.per_step:
        per_step(prof, trace_path, warm_steps, a.out)


def _count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def per_step(prof, trace_path: str, skip: int, out_dir: str) -> None:
    """Kernel time per engine step, summed by step kind (mixed / decode-only) and batch.

    Kernels are ordered by start time and cut after each ``_sample_chunk_kernel`` (one per
    step).  A step's ``span`` runs from its first kernel's start to the next step's; its
    ``idle`` is the part of the span no kernel covers."""
    with open(trace_path) as f:
        trace = [json.loads(line) for line in f][skip:]
    kernels = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
         if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda k: k[0])
    steps: list[list[tuple[float, float, str]]] = [[]]
    for k in kernels:
        steps[-1].append(k)
        if "_sample_chunk_kernel" in k[2]:
            steps.append([])
    steps = [st for st in steps if st]
    rows = []
    by_kind_kernel: dict[str, dict[str, float]] = {}  # step kind -> kernel name -> us
    for i, st in enumerate(steps):
        start = st[0][0]
        end = steps[i + 1][0][0] if i + 1 < len(steps) else max(k[1] for k in st)
        busy, cur_s, cur_e = 0.0, None, None
        by: dict[str, float] = {}
        t = trace[i] if i < len(trace) else {}
        for s0, e0, name in st:
            c = category(name)
            by[c] = by.get(c, 0.0) + (e0 - s0)
            if cur_e is None or s0 > cur_e:
                busy += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s0, e0
            else:
                cur_e = max(cur_e, e0)
        busy += cur_e - cur_s
        kk = by_kind_kernel.setdefault("mixed" if t.get("chunks") else "decode", {})
        for s0, e0, name in st:
            kk[name] = kk.get(name, 0.0) + (e0 - s0)
        rows.append({"step": i, "tokens": t.get("tokens"), "reqs": t.get("reqs"),
                     "prefill": sum(t.get("chunks") or ()),
                     "mixed": bool(t.get("chunks")), "span_ms": (end - start) / 1e3,
                     "idle_ms": (end - start - busy) / 1e3,
                     **{f"{c}_ms": v / 1e3 for c, v in by.items()}})
    with open(os.path.join(out_dir, "steps.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} steps with kernels, {len(trace)} traced steps")

    def bucket(r: dict) -> str:
        if r["mixed"]:
            n = r["tokens"] or 0
            for hi in (256, 512, 1024, 2048):
                if n <= hi:
                    return f"mixed <={hi}"
            return "mixed >2048"
        n = r["reqs"] or 0
        for hi in (8, 32, 64, 128, 192, 256):
            if n <= hi:
                return f"decode <={hi}"
        return "decode >256"

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(bucket(r), []).append(r)
    cols = ("span", "gemm", "attention", "other", "copy", "idle")
    print(f"{'kind':14s} {'steps':>5s} {'tokens':>7s} {'prompt':>7s} " + " ".join(
        f"{c + ' s':>11s}" for c in cols) + "   (totals; per step in ms after /)")
    for name in sorted(groups, key=lambda g: (not g.startswith("mixed"), g)):
        g = groups[name]
        tot = {c: sum(r.get(f"{c}_ms", 0.0) for r in g) for c in cols}
        print(f"{name:14s} {len(g):5d} {sum(r['tokens'] or 0 for r in g):7d} "
              f"{sum(r['prefill'] for r in g):7d} " + " ".join(
            f"{tot[c] / 1e3:5.2f}/{tot[c] / len(g):5.2f}" for c in cols))
    # The kernels behind each kind's time (a prompt step's are what TTFT is made of).
    for kind, kk in by_kind_kernel.items():
        n = sum(1 for r in rows if r["mixed"] == (kind == "mixed"))
        print(f"top kernels of the {n} {kind} steps (total ms / per step ms):")
        for name, us in sorted(kk.items(), key=lambda kv: -kv[1])[:24]:
            print(f"  {us / 1e3:8.2f} {us / 1e3 / max(n, 1):7.3f}  {name[:90]}")


if __name__ == "__main__":
    main()
