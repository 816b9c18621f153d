"""Where does a step's time go?  Host cProfile + CUDA kernel totals for a W1 slice.

Usage: python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 64 --out DIR
Writes host_profile.txt (cProfile by tottime) and kernels.txt (torch.profiler CUDA
kernel totals) and prints the GPU-busy fraction of the timed generate call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import w1, w4, write_dummy_model


def category(name: str) -> str:
    """Coarse kernel class for the summary line."""
    n = name.lower()
    if "paged_attn" in n or "reduce_splits" in n:
        return "attention"
    if any(k in n for k in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "splitk", "xmma")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dummy", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-cprofile", action="store_true",
                    help="CUDA kernels only (cProfile slows the host ~2x, which would "
                    "understate how busy the GPU is)")
    ap.add_argument("--w4", action="store_true",
                    help="profile one W4 request (512 prompt, 256 output tokens) instead")
    a = ap.parse_args()
    vocab_hi = 49000 if a.dummy == "smollm2-135m" else 128000
    llm = LLM(write_dummy_model(a.dummy), load_format="dummy", skip_tokenizer_init=True,
              max_num_batched_tokens=a.max_num_batched_tokens)
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


if __name__ == "__main__":
    main()
