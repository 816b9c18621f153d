"""GPU sanity check for the engine paths: greedy tokens with async scheduling on and off
(CUDA graphs both times) and eager must agree on a dummy-weight model (eager changes GEMM
shapes, so a rare bf16 near-tie may go the other way).  PDL on against off is
``tests/kernels/test_pdl.py``'s (bit for bit).

Usage: python benchmarks/gpu_check.py
"""

from __future__ import annotations

import random

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import write_dummy_model


def main() -> None:
    d = write_dummy_model("smollm2-135m")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 49000) for _ in range(rng.randint(5, 300))]
               for _ in range(24)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(1, 64))
              for _ in prompts]
    results = {}
    for name, kw in {"async": {"async_scheduling": True},
                     "sync": {"async_scheduling": False},
                     "eager": {"async_scheduling": False, "enforce_eager": True}}.items():
        llm = LLM(d, load_format="dummy", model_loader_extra_config={"dummy_init": "normal"},
                  skip_tokenizer_init=True, max_model_len=1024,
                  kv_cache_memory_bytes=2 << 30, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
        del llm
    for name in ("sync", "eager"):
        same = sum(a == b for a, b in zip(results["async"], results[name]))
        print(f"async vs {name}: {same}/{len(prompts)} sequences identical")


if __name__ == "__main__":
    main()
