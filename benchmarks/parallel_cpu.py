"""Tensor parallelism on this host's CPU cores: start-up and throughput of TP=1 vs TP=2
(mp executor, gloo) on the default model, fp32, 64 concurrent requests.

    python benchmarks/parallel_cpu.py --repeats 2 --output-json /tmp/tp.json

Configurations are interleaved (TP=1, TP=2, TP=1, ...) so a change in the machine's load
hits both; each run records the 1-minute load average before it.  TP=1 uses all cores'
threads, each TP=2 rank an equal share (the worker's default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def run(tp: int, n: int, input_len: int, output_len: int) -> dict[str, float]:
    import random

    from pagedllm import LLM, SamplingParams

    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    llm = LLM(tensor_parallel_size=tp, num_threads=cores // tp, quantization="none",
              max_model_len=256,
              max_num_seqs=n, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=256 << 20)
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(input_len)]}
               for _ in range(n)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n * output_len
    llm.llm_engine.shutdown()
    return {"tp": tp, "load_before": load, "startup_s": startup, "gen_s": dt,
            "out_tok_s": n * output_len / dt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    rows = []
    for rep in range(a.repeats):
        for tp in (1, 2):
            r = run(tp, a.num_requests, a.input_len, a.output_len)
            r["repeat"] = rep
            rows.append(r)
            print(json.dumps(r), flush=True)
    for tp in (1, 2):
        mine = [r for r in rows if r["tp"] == tp]
        print(f"TP={tp}: out tok/s median {statistics.median(r['out_tok_s'] for r in mine):.1f}"
              f", start-up median {statistics.median(r['startup_s'] for r in mine):.1f} s")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
