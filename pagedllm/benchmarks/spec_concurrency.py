"""Speculative decoding at high concurrency: does the per-step policy keep a large batch
from getting slower (issue 25's "64 concurrent requests >= 0.97x without speculation")?

``pagedllm bench spec``: two engines in one process -- one without speculation, one
with ``--speculative-config`` (default n-gram, k = 4) -- take turns (A B, then B A, ...)
on the same ``--num-prompts`` requests submitted together (``--concurrency`` at a time,
default all), greedy.  Prompts: the 32 grounded prompts (``benchmarks/grounded.py``,
G32) repeated up to ``--num-prompts`` when the engine has a tokenizer, else random
token ids of the same lengths (``--dummy`` without ``--tokenizer``).  Prints output
tokens/s of both, their ratio, whether the outputs are identical, the mean accepted
length, and how many decode steps carried drafts (and how many of those were probes).

On an H200::

    pagedllm bench spec --model /tmp/gg/smollm2.gguf --tokenizer .tok/smollm2
    pagedllm bench spec --dummy llama3-8b --tokenizer .tok/smollm2
    pagedllm bench spec --dummy llama3-8b --draft-dummy llama3.2-1b

(A random-weight model's greedy output soon repeats itself, which n-gram drafts predict
perfectly: the ``--dummy`` n-gram run measures the cost side at high acceptance; the
``--draft-dummy`` run, at ~0 acceptance, whether the policy turns speculation off.)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, w4
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64,
                   help="Requests per run (G32 repeated to this many).")
    p.add_argument("--concurrency", type=int, default=None,
                   help="Requests submitted together (default: all of them).")
    p.add_argument("--max-tokens", type=int, default=256, help="Output tokens per request.")
    p.add_argument("--rounds", type=int, default=4,
                   help="A/B rounds (each runs both engines; the order alternates).")
    p.add_argument("--workload", default="grounded", choices=["grounded", "random"],
                   help="grounded: G32 (answers copy their input: n-gram drafts pay); "
                        "random: random token ids of G32-like lengths (little to copy).")
    p.add_argument("--draft-dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Speculate with a dummy-weight draft model of this shape (with "
                        "--dummy: its random greedy continuation is almost never the "
                        "target's, so acceptance is ~0 and the policy must turn it off).")
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="A named model shape with random weights (implies --load-format "
                        "dummy; prompts are G32 through --tokenizer if given, else random; "
                        "the engine itself loads no tokenizer).")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


def _prompts(tok: Any, n: int, vocab: int, workload: str) -> tuple[str, list[list[int]]]:
    from pagedllm.benchmarks.grounded import grounded_prompts

    if tok is not None and workload == "grounded":
        base = grounded_prompts(tok)
        label = "G32 (grounded)"
    else:  # random ids, G32-like lengths (~100-150 tokens)
        base = [w4(seed, min(vocab, 128000), 100 + 2 * seed) for seed in range(32)]
        label = "random prompts"
    return label, [base[i % len(base)] for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], sp: Any, concurrency: int,
         ) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()
    out: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        res = llm.generate(prompts[i:i + concurrency], sp, use_tqdm=False)
        out.extend(list(o.outputs[0].token_ids) for o in res)
    return time.perf_counter() - t0, out


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    tok_path = args.tokenizer
    if args.dummy:  # its outputs are random ids: the engine detokenizes nothing
        from pagedllm.benchmarks.workloads import write_dummy_model

        args.model, args.load_format = write_dummy_model(args.dummy), "dummy"
        args.skip_tokenizer_init, args.tokenizer = True, None
    spec_cfg = args.speculative_config or dict(DEFAULT_SPEC)
    if args.draft_dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model

        spec_cfg = {"model": write_dummy_model(args.draft_dummy),
                    "num_speculative_tokens": spec_cfg.get("num_speculative_tokens", 4)}
    if args.kv_cache_memory_bytes is None:  # two engines share the device
        args.kv_cache_memory_bytes = 4 << 30
    args.speculative_config = None
    eargs = engine_args_from_cli(args)
    kw = {k: v for k, v in vars(eargs).items() if k not in ("model", "extra",
                                                            "speculative_config")}
    llms = {"off": LLM(eargs.model, **kw),
            "spec": LLM(eargs.model, speculative_config=spec_cfg, **kw)}
    vocab = llms["off"].llm_engine.config.model_config.vocab_size
    if not args.dummy:
        tok = llms["off"].get_tokenizer()
    elif tok_path is not None:  # G32 through this tokenizer (its ids must fit the vocab)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_path)
    else:
        tok = None
    label, prompts = _prompts(tok, args.num_prompts, vocab, args.workload)
    conc = args.concurrency or len(prompts)
    # ignore_eos with random weights (no meaningful EOS); both engines emit the same
    # tokens either way (greedy), so their token counts match.
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                        ignore_eos=args.dummy is not None)
    for llm in llms.values():  # warm-up: first-call allocations, prompt-sized steps
        _run(llm, prompts[:conc], SamplingParams(temperature=0.0, max_tokens=8), conc)
    spec = llms["spec"].llm_engine.client.core.scheduler.spec
    base = (spec.total_drafts, spec.total_draft_tokens, spec.total_accepted_tokens,
            spec.total_steps, spec.total_spec_steps, spec.policy.num_probes)
    secs = {"off": 0.0, "spec": 0.0}
    tokens = {"off": 0, "spec": 0}
    same = True
    for r in range(args.rounds):
        order = ("off", "spec") if r % 2 == 0 else ("spec", "off")
        outs = {}
        for name in order:
            dt, outs[name] = _run(llms[name], prompts, sp, conc)
            secs[name] += dt
            tokens[name] += sum(map(len, outs[name]))
        same = same and outs["off"] == outs["spec"]
    drafts, draft_tokens, accepted, steps, spec_steps, probes = (
        now - b for now, b in zip((spec.total_drafts, spec.total_draft_tokens,
                                   spec.total_accepted_tokens, spec.total_steps,
                                   spec.total_spec_steps, spec.policy.num_probes), base))
    tps = {n: tokens[n] / secs[n] for n in secs}
    res = {"workload": label, "num_prompts": len(prompts), "concurrency": conc,
           "max_tokens": args.max_tokens, "rounds": args.rounds,
           "speculative_config": spec_cfg, "off_tok_s": tps["off"],
           "spec_tok_s": tps["spec"], "ratio": tps["spec"] / tps["off"],
           "outputs_identical": same, "verify_requests": drafts,
           "draft_tokens": draft_tokens, "accepted_tokens": accepted,
           "mean_accepted_length": 1 + accepted / max(1, drafts),
           "acceptance_rate": accepted / max(1, draft_tokens),
           "decode_steps": steps, "steps_with_drafts": spec_steps, "probes": probes,
           "plain_probes": spec.policy.num_plain_probes,
           "time_factors": [spec.policy.time_factor(False), spec.policy.time_factor(True)],
           "acceptance_estimate": [round(a, 3) for a in spec.policy.acceptance.rates()],
           "step_cost": spec.policy.curve.describe() if spec.policy.curve else None,
           "device": llms["off"].llm_engine.config.device_config.device,
           "date": time.strftime("%Y-%m-%d")}
    print(f"{label}, {len(prompts)} requests, {conc} concurrent, {args.max_tokens} tokens "
          f"max, {args.rounds} A/B rounds, {spec_cfg}")
    print(f"  without speculation: {tps['off']:9.1f} output tok/s")
    print(f"  with speculation:    {tps['spec']:9.1f} output tok/s   ratio "
          f"{res['ratio']:.3f}   outputs identical: {same}")
    print(f"  mean accepted length {res['mean_accepted_length']:.2f} "
          f"(acceptance rate {res['acceptance_rate']:.1%}); decode steps with drafts "
          f"{spec_steps}/{steps} ({probes} probes); acceptance estimate per position "
          f"{res['acceptance_estimate']}")
    print(f"  step cost: {res['step_cost']}; measured/predicted step time: plain "
          f"{res['time_factors'][0]:.2f}, speculating {res['time_factors'][1]:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.spec_concurrency")
    add_args(_p)
    raise SystemExit(main(_p.parse_args()))
