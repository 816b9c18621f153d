"""Parallel configurations on this host: start-up and throughput of TP x PP layouts.

    pagedllm bench parallel --configs 1x1@2,1x1@1,2x1@1 --repeats 1

Each configuration ``TPxPP@THREADS`` (threads per rank) runs in a fresh interpreter, so
start-up counts everything a user waits for: interpreter start, imports, spawning the
ranks, joining the world, loading, sizing the KV cache.  For multi-rank layouts the
ranks' own breakdown (``WorkerReady.startup_s``) is reported too.  Configurations are
interleaved across repeats so a change in the machine's load hits all of them, and the
1-minute load average before each run is recorded: on a shared machine the figures
measure contention as much as the engine.  The workload: the default model (GGUF,
dequantised, fp32), ``--num-requests`` concurrent requests of ``--input-len`` random
prompt tokens and ``--output-len`` new tokens (greedy, EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="1x1@2,1x1@1,2x1@1",
                   help="Comma-separated TPxPP@THREADS layouts (threads per rank).")
    p.add_argument("--repeats", type=int, default=1, help="Runs per configuration.")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-json", default=None, help="Write every run here as JSON.")


def _parse(config: str) -> tuple[int, int, int]:
    try:
        layout, threads = config.split("@")
        tp, pp = layout.split("x")
        return int(tp), int(pp), int(threads)
    except ValueError:
        raise ValueError(f"--configs: {config!r} is not TPxPP@THREADS (e.g. 2x1@1)") from None


def run_one(tp: int, pp: int, threads: int, n: int, input_len: int, output_len: int,
            started: float) -> dict[str, Any]:
    """One configuration, in this (fresh) process; ``started``: when it was spawned."""
    import random

    from pagedllm import LLM, SamplingParams

    imported = time.time() - started  # interpreter start and the imports
    llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=threads,
              quantization="none", max_model_len=256, max_num_seqs=n,
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=256 << 20)
    startup = time.time() - started
    core = llm.llm_engine.client.core
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(input_len)]}
               for _ in range(n)]
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True,
                                                max_tokens=output_len), use_tqdm=False)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n * output_len
    row = {"config": f"{tp}x{pp}@{threads}", "startup_s": startup, "import_s": imported,
           "gen_s": dt,
           "out_tok_s": n * output_len / dt,
           "rank_startup_s": getattr(core.executor, "rank_startup_s", None),
           "max_batches_in_flight": core.max_batches_in_flight}
    llm.llm_engine.shutdown()
    return row


def main(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        _parse(c)
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for c in configs:
            load = os.getloadavg()[0]
            cmd = [sys.executable, "-m", "pagedllm.benchmarks.parallel", "--child", c,
                   str(args.num_requests), str(args.input_len), str(args.output_len),
                   repr(time.time())]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            row.update(repeat=rep, load_before=load)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'config':<10}{'start-up s':>12}{'out tok/s':>11}  (medians)")
    for c in configs:
        mine = [r for r in rows if r["config"] == c]
        print(f"{c:<10}{statistics.median(r['startup_s'] for r in mine):>12.1f}"
              f"{statistics.median(r['out_tok_s'] for r in mine):>11.1f}")
    if args.output_json:
        meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
        with open(args.output_json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _config, _n, _i, _o, _t = sys.argv[2:7]
    _tp, _pp, _threads = _parse(_config)
    print(json.dumps(run_one(_tp, _pp, _threads, int(_n), int(_i), int(_o), float(_t))),
          flush=True)
