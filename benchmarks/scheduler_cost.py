"""Per-step scheduler cost versus tokens already generated (no model: a fake runner).

Usage: python benchmarks/scheduler_cost.py
Runs 64 running decode requests and times schedule() + update_from_output() per step at
several sequence lengths; the per-step time must stay flat as sequences grow.
"""

from __future__ import annotations

import statistics
import time

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    n_req, max_len = 64, 16384
    s = Scheduler(SchedulerConfig(max_num_seqs=n_req, max_num_batched_tokens=8192,
                                  max_model_len=max_len),
                  CacheConfig(block_size=16), num_blocks=n_req * max_len // 16 + 1)
    sp = SamplingParams(temperature=0.0, max_tokens=max_len - 64, ignore_eos=True)
    for i in range(n_req):
        s.add_request(Request(str(i), list(range(1, 33)), sp, eos_token_id=None))
    checkpoints = {64, 1024, 4096, 12288}
    step, samples = 0, []
    print(f"{'tokens/request':>15}{'us/step (median of 200)':>26}")
    while step < max(checkpoints) + 200:
        t0 = time.perf_counter()
        so = s.schedule()
        out = ModelRunnerOutput(list(so.num_scheduled_tokens),
                                [[7] for _ in so.num_scheduled_tokens])
        s.update_from_output(so, out)
        dt = time.perf_counter() - t0
        step += 1
        if any(c <= step < c + 200 for c in checkpoints):
            samples.append(dt)
            if len(samples) == 200:
                print(f"{step - 200 + 32:>15}{1e6 * statistics.median(samples):>26.0f}")
                samples = []


if __name__ == "__main__":
    main()
