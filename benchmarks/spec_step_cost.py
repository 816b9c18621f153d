"""The verify-step cost curve at real contexts (an offline cross-check of the curve the
per-step policy measures at start-up, ``worker/step_cost.py``): the forward + logits
time of a decode step where each of
``B`` requests computes ``q`` tokens (``q = k + 1`` to verify ``k`` drafts), relative to
``q = 1``.  Speculation pays at batch ``B`` while ``cost(B, k + 1) / cost(B, 1)`` stays
below the mean accepted length.

``python benchmarks/spec_step_cost.py [--batch-sizes 1,2,4] [--k 4] [--dummy NAME]``
(any engine flag of ``pagedllm bench latency`` too, e.g. ``--dummy llama3-8b`` on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, write_dummy_model
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli


def main() -> None:
    from pagedllm import LLM
    from pagedllm.worker.input_batch import InputBatch

    p = argparse.ArgumentParser(prog="benchmarks/spec_step_cost.py")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="Tokens already in the cache.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Benchmark a named model shape with random weights (implies "
                        "--load-format dummy).")
    add_engine_args(p)
    args = p.parse_args()
    # Verify steps need every row's hidden state; with speculation on, the runner captures
    # its chunk graphs that way (model_runner), so time those graphs here too: the engine
    # runs in this process, so its runner is built with ``last_only`` off.
    from pagedllm.worker.model_runner import ModelRunner

    init = ModelRunner.__init__

    def init_all_rows(self: ModelRunner, *a: object, **kw: object) -> None:
        init(self, *a, **kw)  # type: ignore[arg-type]
        self.last_only = False

    ModelRunner.__init__ = init_all_rows  # type: ignore[method-assign]
    if args.dummy:
        args.model, args.load_format = write_dummy_model(args.dummy), "dummy"
        args.skip_tokenizer_init = True
    eargs = engine_args_from_cli(args)
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    runner = llm.llm_engine.client.core.executor.worker.runner
    bs = runner.block_size
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    q_max = args.k + 1
    per_req = -(-(args.context + q_max) // bs)
    num_blocks = llm.llm_engine.client.core.num_blocks
    qs = list(range(1, q_max + 1))
    print(f"context {args.context}, k {args.k}: ms per step (median of {args.repeats}), "
          "and each q's cost relative to q=1")
    print(f"{'batch':>6}" + "".join(f"{f'q={q}':>9}" for q in qs) + "   ratios")
    for b in sizes:
        if b * per_req >= num_blocks:
            print(f"{b:>6}  (KV cache too small)")
            break
        batch = InputBatch(b, args.context + q_max, bs)
        rng = np.random.default_rng(0)
        for i in range(b):
            batch.add(str(i), rng.integers(100, 1000, args.context + q_max).tolist(),
                      list(range(1 + i * per_req, 1 + (i + 1) * per_req)))
        rows = np.arange(b)
        ms = {}
        for q in qs:
            inp = batch.prepare(rows, np.full(b, args.context), np.full(b, q))
            times = []
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    # The runner's forward: a CUDA-graph replay where a captured shape
                    # fits (as a verify step runs), eager otherwise.
                    h = runner._forward(inp, None, False)
                    runner.model.compute_logits(h).argmax(-1).cpu()
                times.append(time.perf_counter() - t0)
            ms[q] = 1000 * statistics.median(times[1:])
        print(f"{b:>6}" + "".join(f"{ms[q]:>9.2f}" for q in qs) + "   "
              + " ".join(f"{ms[q] / ms[1]:.2f}" for q in qs))


if __name__ == "__main__":
    main()
