"""Which host code synchronises with the GPU during a W1 slice?  (On the GPU machine.)

    python benchmarks/sync_probe.py [--num-prompts 32]

Runs the first W1 requests (8,192-token eager prefill steps, then decodes) with
``torch.cuda.set_sync_debug_mode("warn")`` and prints each distinct Python stack that
triggered a synchronising CUDA call, with its count, then the caching allocator's retry
and cudaMalloc/cudaFree counts (a retry frees cached blocks, which synchronises too).
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import w1, write_dummy_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    llm = LLM(write_dummy_model("llama3-8b"), load_format="dummy", skip_tokenizer_init=True)
    reqs = w1(a.num_prompts)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=a.max_tokens)
    llm.generate([r.prompt_token_ids for r in w1(4, seed=1)], params, use_tqdm=False)
    llm.reset_prefix_cache()
    stacks: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "pagedllm" in f.filename]
        stacks[str(message).split("\n")[0] + "\n" + "".join(
            traceback.format_list(frames[-6:]))] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("warn")
    llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    torch.cuda.set_sync_debug_mode(0)
    after = torch.cuda.memory_stats()
    print(f"{sum(stacks.values())} synchronising calls at {len(stacks)} places")
    for s, n in stacks.most_common(12):
        print(f"--- {n} x {s}")
    for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
        print(f"{k}: {after.get(k, 0) - before.get(k, 0)}")


if __name__ == "__main__":
    main()
