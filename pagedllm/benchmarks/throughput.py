"""Offline throughput: pagedllm vs HF Transformers on the same requests, same process.

Workloads (BENCHMARKS.md): C1 (CPU, default model, 64 chat prompts, 128 tokens each, at
the batch sizes given), W1 / W1-small (256 random token-id prompts), W3 (shared prefix),
W5 (384 long prompts),
V1 (vision-language: one 448x448 image + 64-256 text tokens per request, 128 out; with
``--repeat-image`` every request the same image; reports the encoder cache's hits and the
encoder's share of the wall time, ``vlm.py``),
or ``custom`` (``--input-len``/``--output-len``/``--num-prompts``).  Prints a table and
writes JSON with ``--output-json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

from pagedllm.benchmarks.lora_adapters import (
    add_lora_bench_args,
    apply_lora_bench_args,
    spread,
    write_dummy_adapters,
)
from pagedllm.benchmarks.workloads import (
    DUMMY_CONFIGS,
    BenchRequest,
    add_dummy_overrides_arg,
    c1_messages,
    engine_summary,
    kv_block_bytes,
    kv_peak_tracker,
    summary_line,
    v1,
    w1,
    w3,
    w5,
)
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="C1",
                   choices=["C1", "W1", "W1-small", "W3", "W5", "V1", "custom"],
                   help="Which seeded workload to run (docs/benchmarks.md, 'Workloads'): "
                        "C1 = 64 chat prompts on the default model; W1 = 256 random "
                        "token prompts of 128-1024 tokens, 32-512 output tokens; "
                        "W1-small = W1 for 49k-vocabulary models; W3 = a 2,048-token "
                        "shared prefix; W5 = 384 long prompts (64-2048 tokens, "
                        "16-768 out); V1 = 256 requests of one 448x448 image + "
                        "64-256 text tokens, --output-len (128) out, on a "
                        "vision-language model; custom = --input-len/--output-len.")
    p.add_argument("--repeat-image", action="store_true",
                   help="V1: every request carries the same image (encoder-cache and "
                        "prefix-cache hits) instead of one image each.")
    p.add_argument("--vocab-hi", type=int, default=None,
                   help="W1: draw the token ids below this bound (randrange(1000, N): a "
                        "different draw, as vLLM's DeepSeek-V2-Lite run with 102399, "
                        "68,960 output tokens) instead of folding W1's ids below a "
                        "smaller vocabulary (W1's lengths).")
    p.add_argument("--image-size", type=int, default=448,
                   help="V1: side of the square synthetic images, in pixels.")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Also draw output tokens/s per configuration into this PNG "
                        "(matplotlib).")
    p.add_argument("--batch-sizes", default="1,64",
                   help="C1/custom: comma-separated batch sizes (requests submitted "
                        "together; C1 takes the first N prompts).")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="Number of requests (W1/W3/custom); default: the workload's.")
    p.add_argument("--input-len", type=int, default=128, help="custom: prompt tokens.")
    p.add_argument("--prefix-len", type=int, default=2048,
                   help="W3: tokens of the prefix every request shares (shorter on CPU).")
    p.add_argument("--output-len", type=int, default=128,
                   help="C1/V1/custom: tokens generated per request (EOS ignored).")
    p.add_argument("--repeats", type=int, default=1,
                   help="Timed runs per configuration; the median is reported.")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="Also time HF Transformers generate() on the same requests.")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF static batch size (default: the batch size being measured).")
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="Time HF on only the first N requests of each configuration (HF "
                        "is slow; its tok/s is still comparable).")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    p.add_argument("--step-log", default=None, metavar="FILE.json",
                   help="Log every engine step of the timed runs (scheduled tokens and "
                        "requests, seconds) to this file and print the last run's time "
                        "by step kind (decode-only or mixed) and padded size "
                        "(benchmarks/step_log.py). Default: off.")
    p.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                   help="Batch-1 rows of a GGUF model: also time llama.cpp on the same "
                        "file and prompts, run by this Python interpreter, which must have "
                        "llama-cpp-python installed (pagedllm/benchmarks/llamacpp_ref.py); "
                        "skipped with a note when not given.")
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Benchmark a named model shape with random weights (writes its "
                        "config.json to a temp dir; implies --load-format dummy).")
    add_dummy_overrides_arg(p)
    add_engine_args(p)
    add_lora_bench_args(p)


def _requests(args: argparse.Namespace, llm: Any) -> list[BenchRequest]:
    if args.workload == "C1":
        ip = llm.llm_engine.input_processor
        return [BenchRequest(ip.apply_chat_template(m), args.output_len)
                for m in c1_messages(64)]
    vocab = llm.llm_engine.config.model_config.vocab_size
    if args.workload in ("W1", "W1-small"):
        reqs = w1(args.num_prompts or 256, vocab_hi=args.vocab_hi or (
            49000 if args.workload == "W1-small" else 128000))
        if vocab < 128000 and args.workload == "W1" and args.vocab_hi is None:
            # W1's ids reach 128,000; for a smaller vocabulary (Mixtral's 32,000) fold
            # them below its size, so the requests' lengths stay W1's exactly.
            reqs = [BenchRequest([1000 + (t - 1000) % (vocab - 1000)
                                  for t in r.prompt_token_ids],
                                 r.output_len) for r in reqs]
        return reqs
    if args.workload == "W5":
        return w5(args.num_prompts or 384)
    if args.workload == "V1":
        from pagedllm.benchmarks.vlm import image_run

        return v1(image_run(llm, args.image_size), args.num_prompts or 256,
                  vocab_hi=min(vocab, 128000), output_len=args.output_len,
                  image_size=args.image_size, repeat_image=args.repeat_image)
    if args.workload == "W3":
        return w3(args.num_prompts or 256, prefix_len=args.prefix_len,
                  vocab_hi=min(vocab, 128000))
    import random

    rng = random.Random(0)
    return [BenchRequest([rng.randrange(1000, 20000) for _ in range(args.input_len)],
                         args.output_len) for _ in range(args.num_prompts or 64)]


def _run_pagedllm(llm: Any, reqs: list[BenchRequest], loras: list[Any] | None = None,
                  peaks: dict[str, int] | None = None, step_log: Any = None) -> float:
    """Seconds to generate ``reqs``; ``peaks`` receives the run's peak KV blocks in use
    and peak running requests (when the engine core is in this process), and the prompt
    tokens served from the prefix cache; ``step_log`` (a ``StepLog``) records the run's
    steps."""
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
              for r in reqs]
    # Every timed run starts cold: only sharing *within* the run (W3's common prefix)
    # may hit the prefix cache, never blocks left by the warm-up or an earlier repeat.
    llm.reset_prefix_cache()
    sched = kv_peak_tracker(llm)
    if sched is not None:
        sched.kv.pool.reset_peak()
        sched.peak_num_running = 0
    if step_log is not None:
        step_log.start()
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False,
                        lora_request=spread(loras or [], len(reqs)))
    dt = time.perf_counter() - t0
    if step_log is not None:
        step_log.stop()
    if sched is not None and peaks is not None:
        peaks["kv_peak_blocks"] = max(peaks.get("kv_peak_blocks", 0),
                                      sched.kv.pool.peak_blocks_in_use)
        peaks["peak_running"] = max(peaks.get("peak_running", 0), sched.peak_num_running)
    if peaks is not None:
        peaks["cached_prompt_tokens"] = sum(o.num_cached_tokens for o in outs)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(r.output_len for r in reqs)
    return dt


def build_llm(args: argparse.Namespace) -> Any:
    """The ``LLM`` the parsed flags describe (``--dummy``: that shape, dummy weights)."""
    from pagedllm import LLM

    if args.dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model

        args.model = write_dummy_model(args.dummy, overrides=args.dummy_overrides)
        args.load_format, args.skip_tokenizer_init = "dummy", True
    apply_lora_bench_args(args)
    eargs = engine_args_from_cli(args)
    kwargs = {k: v for k, v in vars(eargs).items() if k not in ("model", "extra")}
    return LLM(eargs.model, **kwargs)


def warmup_requests(reqs: list[BenchRequest]) -> list[BenchRequest]:
    """8 of the workload's prompts at full length, 8 tokens each."""
    return [BenchRequest(r.prompt_token_ids, 8, r.images) for r in reqs[-8:]]


def main(args: argparse.Namespace) -> int:
    import torch

    from pagedllm.benchmarks.plot import check_plot_path

    check_plot_path(args.plot)

    step_log = None
    if args.step_log:  # before the engine: its core opens the step trace at start-up
        from pagedllm.benchmarks.step_log import StepLog

        step_log = StepLog()
    llm = build_llm(args)
    all_reqs = _requests(args, llm)
    # --lora N: requests spread evenly over N dummy adapters (lora_adapters.py).
    loras = write_dummy_adapters(llm.llm_engine.config.model_config.hf_config, args.lora,
                                 args.lora_rank) if args.lora else []
    if args.workload in ("C1", "custom"):
        groups = [(f"batch {b}", all_reqs[:b]) for b in
                  (int(x) for x in args.batch_sizes.split(","))]
    else:
        groups = [(args.workload, all_reqs)]
    # Warm-up (allocator, kernels and cuBLAS for prefill-sized steps; decode graphs are
    # captured at start).
    _run_pagedllm(llm, warmup_requests(all_reqs), loras)
    probe = None
    if args.workload == "V1":  # the encoder cache's counters and timer (vlm.py)
        from pagedllm.benchmarks.vlm import EncoderProbe, processor_seconds

        probe = EncoderProbe(llm)

    hf_model = None
    if args.hf:
        from pagedllm.benchmarks.hf_baseline import load_hf_model
        from pagedllm.worker.worker import torch_dtype

        cfg = llm.llm_engine.config
        hf_model = load_hf_model(cfg.model_config, cfg.device_config.device,
                                 torch_dtype(cfg.model_config.dtype))
    rows = []
    for name, reqs in groups:
        n_out = sum(r.output_len for r in reqs)
        n_in = sum(len(r.prompt_token_ids) for r in reqs)
        peaks: dict[str, int] = {}
        if probe is not None:
            probe.reset()
        runs = [_run_pagedllm(llm, reqs, loras, peaks, step_log)
                for _ in range(args.repeats)]
        ours = statistics.median(runs)
        row: dict[str, Any] = {"config": name, "requests": len(reqs), "prompt_tokens": n_in,
                               "output_tokens": n_out, "pagedllm_s": ours,
                               "pagedllm_runs_s": runs,
                               "pagedllm_out_tok_s": n_out / ours,
                               "pagedllm_total_tok_s": (n_in + n_out) / ours}
        if "kv_peak_blocks" in peaks:  # KV blocks in use at the peak, their memory
            row.update(kv_peak_gib=peaks["kv_peak_blocks"] * kv_block_bytes(llm) / 2**30)
        row.update(peaks, prefix_cache_hit_rate=peaks["cached_prompt_tokens"] / max(1, n_in))
        if probe is not None:  # per run: encoder cache hits, encoder time and share
            enc = probe.stats(sum(runs))
            row.update({k: v / len(runs) if k in ("images_encoded", "encoder_cache_hits",
                                                   "encoder_s") else v
                        for k, v in enc.items()}, images=len(reqs),
                       repeat_image=args.repeat_image, image_size=args.image_size,
                       processor_s=processor_seconds(llm, [r.prompt for r in reqs]))
        if hf_model is not None:
            from pagedllm.benchmarks.hf_baseline import hf_generate

            hf_reqs = reqs[:args.hf_num_prompts] if args.hf_num_prompts else reqs
            bs = args.hf_batch_size or len(hf_reqs)
            hf_s = statistics.median(
                hf_generate(hf_model, [r.prompt_token_ids for r in hf_reqs],
                            [r.output_len for r in hf_reqs], bs)[0]
                for _ in range(args.repeats))
            hf_tps = sum(r.output_len for r in hf_reqs) / hf_s
            row.update(hf_requests=len(hf_reqs), hf_s=hf_s, hf_out_tok_s=hf_tps,
                       ratio=(n_out / ours) / hf_tps)
        _add_llamacpp(args, llm, reqs, row)
        rows.append(row)
    summary = engine_summary(llm)
    print(summary_line(summary))
    _print_table(rows)
    for r in rows:
        if "encoder_share" in r:
            print(f"{r['config']}: {r['images']} images, {r['images_encoded']:.0f} encoded, "
                  f"encoder-cache hit rate {r['encoder_cache_hit_rate']:.1%}, encoder "
                  f"{r['encoder_s']:.2f} s = {r['encoder_share']:.1%} of the wall time, "
                  f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.1%}; the front "
                  f"end's processor takes {r['processor_s']:.2f} s for the requests")
    if step_log is not None:
        from pagedllm.benchmarks import step_log as sl

        logged = step_log.runs()
        steps = sl.summarise(logged[-1], *step_log.ladders(llm), step_log.replay_ms(llm))
        print(f"steps of the last timed run ({groups[-1][0]}):")
        sl.print_summary(steps)
        sl.write(args.step_log, logged, steps)
        step_log.close()
    if args.plot:
        from pagedllm.benchmarks.plot import plot_throughput

        plot_throughput(rows, args.plot, f"pagedllm bench throughput: {args.workload}")
    if args.output_json:
        meta = {"workload": args.workload, "device": llm.llm_engine.config.device_config.device,
                "lora_adapters": args.lora, "lora_rank": args.lora_rank if args.lora else None,
                **summary,
                "threads": torch.get_num_threads(), "machine": platform.processor() or
                platform.machine(), "date": time.strftime("%Y-%m-%d")}
        with open(args.output_json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


def _add_llamacpp(args: argparse.Namespace, llm: Any, reqs: list[BenchRequest],
                  row: dict[str, Any]) -> None:
    """The optional llama.cpp column (``llamacpp_ref.py``) for batch-1 rows of a GGUF."""
    if len(reqs) != 1:
        return
    gguf = getattr(llm.llm_engine.config.model_config.resolved, "gguf_path", None)
    if args.llama_cpp_python is None or gguf is None:
        row["llamacpp_skipped"] = ("llama.cpp column skipped: " + (
            "not a GGUF model" if gguf is None else
            "pass --llama-cpp-python PYTHON (an interpreter with llama-cpp-python)"))
        print(row["llamacpp_skipped"])
        return
    import torch

    from pagedllm.benchmarks.llamacpp_ref import llamacpp_batch1

    res = llamacpp_batch1(args.llama_cpp_python, gguf, [r.prompt_token_ids for r in reqs],
                          reqs[0].output_len, torch.get_num_threads(), args.repeats)
    if "skipped" in res:
        row["llamacpp_skipped"] = res["skipped"]
        print(res["skipped"])
        return
    row.update(llamacpp_out_tok_s=res["out_tok_s"], llamacpp_runs_s=res["runs_s"],
               llamacpp_version=res["version"],
               ratio_llamacpp=row["pagedllm_out_tok_s"] / res["out_tok_s"])


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'config':<12}{'reqs':>6}{'out tok':>9}{'pagedllm tok/s':>16}"
    has_peak = any("kv_peak_blocks" in r for r in rows)
    if has_peak:
        head += f"{'peak KV blocks':>16}{'peak KV GiB':>13}{'peak running':>14}"
    has_hf = any("hf_out_tok_s" in r for r in rows)
    if has_hf:
        head += f"{'HF tok/s':>11}{'ratio':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (f"{r['config']:<12}{r['requests']:>6}{r['output_tokens']:>9}"
                f"{r['pagedllm_out_tok_s']:>16.1f}")
        if has_peak:
            line += (f"{r.get('kv_peak_blocks', 0):>16}{r.get('kv_peak_gib', 0.0):>13.2f}"
                     f"{r.get('peak_running', 0):>14}")
        if has_hf and "hf_out_tok_s" in r:
            line += f"{r['hf_out_tok_s']:>11.1f}{r['ratio']:>7.2f}x"
        if "llamacpp_out_tok_s" in r:
            line += (f"   llama.cpp {r['llamacpp_out_tok_s']:.1f} tok/s "
                     f"({r['ratio_llamacpp']:.2f}x)")
        print(line)
