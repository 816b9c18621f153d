"""Replay W5 through the real scheduler and KV manager (no model) for the Gemma-3-12B
shape, with and without the hybrid KV cache manager, in a KV budget the size of an
H200's: how many requests run at once, the KV memory they hold at the peak, steps,
preemptions.  It prices nothing -- ``pagedllm bench throughput --workload W5 --dummy
gemma-3-12b`` on the device says what the tokens per second are.

Usage: python benchmarks/hybrid_kv_sim.py [--kv-gib 90] [--num-prompts 384]

A null runner "samples" a token whenever a request's known tokens are all computed
(recompute preemption included: a resumed request computes its prompt and outputs again).
"""

from __future__ import annotations

import argparse
import time

from pagedllm.attention.kinds import layer_sliding_windows
from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, w5
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


class _Cfg:
    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)


class _NullRunner:
    def __init__(self) -> None:
        self.left: dict[str, int] = {}  # known tokens not yet computed

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.left.pop(rid, None)
        for nr in so.new_reqs:
            self.left[nr.req_id] = (len(nr.prompt_token_ids) + len(nr.output_token_ids)
                                    - nr.num_computed_tokens)
        ids, toks = list(so.num_scheduled_tokens), []
        for rid, n in so.num_scheduled_tokens.items():
            left = self.left[rid] - n
            sampled = left <= 0
            toks.append([7] if sampled else [])
            self.left[rid] = 1 if sampled else left  # the sampled token: computed next
        return ModelRunnerOutput(ids, toks)


def simulate(hybrid: bool, kv_gib: float, num_prompts: int, block_size: int = 16,
             budget: int = 8192) -> dict[str, float]:
    cfg = _Cfg(DUMMY_CONFIGS["gemma-3-12b"])
    groups = make_kv_cache_groups(layer_sliding_windows(cfg), hybrid=hybrid)
    per_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K, V in bf16
    block_bytes = per_layer_token * block_size * groups.num_tensors
    num_blocks = int(kv_gib * 2**30 // block_bytes)
    max_len = 4096
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget,
                                  max_model_len=max_len, async_scheduling=False),
                  CacheConfig(block_size=block_size, enable_prefix_caching=True,
                              kv_cache_groups=groups), num_blocks=num_blocks)
    for i, r in enumerate(w5(num_prompts)):
        s.add_request(Request(str(i), r.prompt_token_ids, SamplingParams(
            temperature=0.0, max_tokens=r.output_len, ignore_eos=True), None))
    runner = _NullRunner()
    steps = decode_rows = 0
    t0 = time.perf_counter()
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        steps += 1
        decode_rows += sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
    return {"blocks": num_blocks - 1, "block_mib": block_bytes / 2**20,
            "peak_blocks": s.kv.pool.peak_blocks_in_use,
            "peak_gib": s.kv.pool.peak_blocks_in_use * block_bytes / 2**30,
            "peak_running": s.peak_num_running, "steps": steps,
            "mean_decode_batch": decode_rows / steps, "preemptions": s.total_preemptions,
            "host_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=90.0)
    ap.add_argument("--num-prompts", type=int, default=384)
    a = ap.parse_args()
    print(f"{'hybrid':>7}{'blocks':>8}{'MiB/blk':>8}{'peak blk':>9}{'peak GiB':>9}"
          f"{'peak run':>9}{'steps':>7}{'dec/step':>9}{'preempt':>8}{'host s':>7}")
    for hybrid in (True, False):
        r = simulate(hybrid, a.kv_gib, a.num_prompts)
        print(f"{hybrid!s:>7}{r['blocks']:>8}{r['block_mib']:>8.2f}{r['peak_blocks']:>9}"
              f"{r['peak_gib']:>9.1f}{r['peak_running']:>9}{r['steps']:>7}"
              f"{r['mean_decode_batch']:>9.1f}{r['preemptions']:>8}{r['host_s']:>7.1f}")


if __name__ == "__main__":
    main()
