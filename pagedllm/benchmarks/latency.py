"""Single-stream latency (W4): TTFT and TPOT of one request, median of 3 fresh prompts.

TTFT = time of a 1-token request; TPOT = (t(output_len) - t(1)) / (output_len - 1).
``--workload grounded`` takes the prompts from the input-grounded set
(``benchmarks/grounded.py``) instead of random tokens; ``--workload V1`` one V1 request
each (one 448x448 image + 64-256 text tokens, a fresh image per prompt, 128 output
tokens by default; ``vlm.py``), also reporting the encoder's time in the TTFT.  With
``--speculative-config`` the acceptance is reported too: mean accepted length = 1 +
accepted / verify steps (tokens per target forward), and the acceptance rate = accepted
/ draft tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.benchmarks.lora_adapters import (
    add_lora_bench_args,
    apply_lora_bench_args,
    write_dummy_adapters,
)
from pagedllm.benchmarks.workloads import (
    DUMMY_CONFIGS,
    BenchRequest,
    add_dummy_overrides_arg,
    engine_summary,
    summary_line,
    synthetic_image,
    v1,
    w4,
)
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=512, help="Prompt tokens.")
    p.add_argument("--output-len", type=int, default=None,
                   help="Generated tokens (default 256; V1: 128).")
    p.add_argument("--num-prompts", type=int, default=3,
                   help="Fresh random prompts; medians are reported.")
    p.add_argument("--vocab-hi", type=int, default=None,
                   help="Upper bound of random token ids (default: min(vocab, 128000)).")
    p.add_argument("--workload", default="random", choices=["random", "grounded", "V1"],
                   help="Prompts: random tokens (W4), the 32 input-grounded edit and "
                        "summary prompts (--num-prompts of them, in order), or V1's "
                        "image requests (a vision-language model).")
    p.add_argument("--image-size", type=int, default=448,
                   help="V1: side of the square synthetic images, in pixels.")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Also draw every prompt's TTFT and TPOT into this PNG (matplotlib).")
    p.add_argument("--draft-dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Speculative decoding with a dummy-weight draft model of this shape "
                        "(with --dummy; sets speculative_config's model; acceptance is "
                        "meaningless with random weights: this measures the draft's cost). "
                        "An EAGLE head shape (eagle-llama3-8b, eagle3-llama3-8b) needs "
                        "speculative_config's method eagle / eagle3.")
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Benchmark a named model shape with random weights (writes its "
                        "config.json to a temp dir; implies --load-format dummy).")
    add_dummy_overrides_arg(p)
    add_engine_args(p)
    add_lora_bench_args(p)


def _timed(llm: Any, prompt: Any, n: int, lora: Any = None) -> float:
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    # Each prompt runs twice (1 token, then output_len): without a reset the second run
    # would find its prompt in the prefix cache and report a TTFT of ~one token.
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.benchmarks.plot import check_plot_path

    check_plot_path(args.plot)

    if args.dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model

        args.model = write_dummy_model(args.dummy, overrides=args.dummy_overrides)
        args.load_format, args.skip_tokenizer_init = "dummy", True
    if args.draft_dummy:  # a dummy-weight draft model for the dummy target
        from pagedllm.benchmarks.workloads import write_dummy_model

        args.speculative_config = {**(args.speculative_config or {}),
                                   "model": write_dummy_model(args.draft_dummy)}
        args.speculative_config.setdefault("num_speculative_tokens", 4)
    apply_lora_bench_args(args)
    eargs = engine_args_from_cli(args)
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    vocab = llm.llm_engine.config.model_config.vocab_size
    hi = args.vocab_hi or min(vocab, 128000)
    # --lora N: every request runs with the first of N dummy adapters.
    lora = write_dummy_adapters(llm.llm_engine.config.model_config.hf_config, args.lora,
                                args.lora_rank)[0] if args.lora else None
    if args.output_len is None:
        args.output_len = 128 if args.workload == "V1" else 256
    probe = None
    prompts: list[Any]
    if args.workload == "V1":  # one fresh image per prompt (vlm.py)
        from pagedllm.benchmarks.vlm import EncoderProbe, image_run, processor_seconds

        run = image_run(llm, args.image_size)
        _timed(llm, BenchRequest(run + w4(100, hi, 64), 8,
                                 [synthetic_image(100, args.image_size)]).prompt, 8, lora)
        prompts = [r.prompt for r in v1(run, args.num_prompts, vocab_hi=hi,
                                        image_size=args.image_size)]
        probe = EncoderProbe(llm)
    elif args.workload == "grounded":
        from pagedllm.benchmarks.grounded import grounded_prompts

        _timed(llm, w4(100, hi, args.input_len), 8, lora)  # warm-up
        prompts = grounded_prompts(llm.get_tokenizer())[:args.num_prompts]
    else:
        _timed(llm, w4(100, hi, args.input_len), 8, lora)  # warm-up
        prompts = [w4(seed, hi, args.input_len) for seed in range(args.num_prompts)]
    spec = llm.llm_engine.client.core.scheduler.spec
    base = (spec.total_drafts, spec.total_draft_tokens, spec.total_accepted_tokens) \
        if spec is not None else (0, 0, 0)  # the warm-up's drafts are not counted
    ttft, tpot, enc = [], [], []
    for prompt in prompts:
        if probe is not None:
            probe.reset()
        t1 = _timed(llm, prompt, 1, lora)
        if probe is not None:  # the encoder's part of this TTFT
            enc.append(probe.stats(t1))
        tn = _timed(llm, prompt, args.output_len, lora)
        ttft.append(t1)
        tpot.append((tn - t1) / (args.output_len - 1))
    res = {"ttft_ms": 1000 * statistics.median(ttft), "tpot_ms": 1000 * statistics.median(tpot),
           "ttft_all_ms": [1000 * x for x in ttft], "tpot_all_ms": [1000 * x for x in tpot],
           "input_len": args.input_len if args.workload == "random" else
           statistics.mean(len(p["prompt_token_ids"] if isinstance(p, dict) else p)
                           for p in prompts), "output_len": args.output_len,
           "workload": args.workload, "lora_adapters": args.lora,
           "device": llm.llm_engine.config.device_config.device,
           "date": time.strftime("%Y-%m-%d"), **engine_summary(llm)}
    if enc and "encoder_s" in enc[0]:
        res["ttft_encoder_ms"] = 1000 * statistics.median(e["encoder_s"] for e in enc)
        res["ttft_encoder_share"] = statistics.median(e["encoder_share"] for e in enc)
        res["ttft_processor_ms"] = 1000 * statistics.median(
            processor_seconds(llm, [p]) for p in prompts)
        res["image_size"] = args.image_size
    if spec is not None:
        drafts, draft_tokens, accepted = (spec.total_drafts - base[0],
                                          spec.total_draft_tokens - base[1],
                                          spec.total_accepted_tokens - base[2])
        res["spec_decode"] = {
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "mean_accepted_length": 1 + accepted / max(1, drafts),
            "acceptance_rate": accepted / max(1, draft_tokens)}
    print(summary_line(res))
    print(f"{'metric':<10}{'median ms':>12}")
    print(f"{'TTFT':<10}{res['ttft_ms']:>12.2f}")
    print(f"{'TPOT':<10}{res['tpot_ms']:>12.2f}")
    if "ttft_encoder_ms" in res:
        print(f"{'encoder':<10}{res['ttft_encoder_ms']:>12.2f}   "
              f"({res['ttft_encoder_share']:.1%} of the TTFT)")
        print(f"{'processor':<10}{res['ttft_processor_ms']:>12.2f}   (the front end, "
              "before the engine core)")
    if "spec_decode" in res:
        sd = res["spec_decode"]
        print(f"spec decode: mean accepted length {sd['mean_accepted_length']:.2f} tokens "
              f"per verify step, acceptance rate {sd['acceptance_rate']:.2%} "
              f"({sd['accepted_tokens']}/{sd['draft_tokens']} draft tokens)")
    if args.plot:
        from pagedllm.benchmarks.plot import plot_latency

        plot_latency(res, args.plot)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
