"""KV blocks in use with and without block sharing: n = 4 parallel sampling and beam width
4 on a 512-token prompt with 128 new tokens (issue 5's measurement).

Usage: python benchmarks/memory_sharing.py [--prompt-len 512] [--new 128] [--width 4]

Runs the real engine (default model, CPU is fine: block counts do not depend on speed)
step by step and records the peak number of KV blocks referenced:

* n = 4, shared: one request with ``n=4`` (prompt computed once, blocks shared, the
  partial block copied on write);
* n = 4, not shared: 4 independent requests with prefix caching off;
* beam width 4, shared: ``use_beam_search`` (beams fork and share prefix blocks);
* beam width 4, not shared: what the same live beams would hold with private blocks
  (sum over live beams of ceil(tokens / block_size)), sampled at every step.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable

from pagedllm import LLM, SamplingParams


def _peak(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
          extra: Callable[[object], int] | None = None) -> tuple[int, int]:
    """Run to completion one engine step at a time; return (peak blocks in use, peak of
    ``extra(scheduler)``)."""
    eng = llm.llm_engine
    sched = eng.client.core.scheduler
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"m{i}", {"prompt_token_ids": p}, sp)
    peak = peak_extra = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, sched.kv.num_usable_blocks - sched.kv.num_free_blocks)
        if extra is not None:
            peak_extra = max(peak_extra, extra(sched))
    return peak, peak_extra


def _private_blocks(sched) -> int:
    bs = sched.block_size
    return sum(-(-r.num_computed_tokens // bs) for r in sched.running)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 49000) for _ in range(args.prompt_len)]
    k, new = args.width, args.new
    common = dict(kv_cache_memory_bytes=1 << 30, max_model_len=2048,
                  max_num_batched_tokens=1024)
    shared_llm = LLM(**common)
    sp = SamplingParams(n=k, temperature=0.8, seed=1, max_tokens=new, ignore_eos=True)
    n_shared, _ = _peak(shared_llm, [prompt], [sp])
    beam = SamplingParams(n=k, temperature=0.0, max_tokens=new, ignore_eos=True,
                          use_beam_search=True)
    b_shared, b_private = _peak(shared_llm, [prompt], [beam], _private_blocks)
    del shared_llm
    off = LLM(enable_prefix_caching=False, **common)
    n_private, _ = _peak(off, [prompt] * k, [
        SamplingParams(temperature=0.8, seed=1 + i, max_tokens=new, ignore_eos=True)
        for i in range(k)])
    rows = {
        f"n={k} sampling": (n_shared, n_private),
        f"beam width {k}": (b_shared, b_private),
    }
    print(f"prompt {args.prompt_len} tokens, {new} new, block size 16")
    print(f"{'':<18}{'shared':>8}{'not shared':>12}{'saving':>9}")
    for name, (sh, pr) in rows.items():
        print(f"{name:<18}{sh:>8}{pr:>12}{1 - sh / pr:>8.0%}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({k: {"shared": v[0], "not_shared": v[1]} for k, v in rows.items()}, f)


if __name__ == "__main__":
    main()
