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
from pagedllm.benchmarks.workloads import w1, write_dummy_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dummy", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    a = ap.parse_args()
    vocab_hi = 49000 if a.dummy == "smollm2-135m" else 128000
    llm = LLM(write_dummy_model(a.dummy), load_format="dummy", skip_tokenizer_init=True,
              max_num_batched_tokens=a.max_num_batched_tokens)
    reqs = w1(a.num_prompts, vocab_hi=vocab_hi)
    prompts = [r.prompt_token_ids for r in reqs]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len)
              for r in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    pr = cProfile.Profile()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pr.enable()
        llm.generate(prompts, params, use_tqdm=False)
        pr.disable()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    with open(os.path.join(a.out, "host_profile.txt"), "w") as f:
        f.write(s.getvalue())
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka)
    table = ka.table(sort_by="self_device_time_total", row_limit=30)
    with open(os.path.join(a.out, "kernels.txt"), "w") as f:
        f.write(table)
    out_tokens = sum(r.output_len for r in reqs)
    print(f"wall {wall:.2f} s (under profilers), GPU busy {gpu_us / 1e6:.2f} s = "
          f"{100 * gpu_us / 1e6 / wall:.0f}%, {out_tokens / wall:.0f} out tok/s")
    print(table[:6000])
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
