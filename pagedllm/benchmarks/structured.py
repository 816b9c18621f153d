"""Structured-decoding overhead: TPOT of N concurrent requests with and without one
shared JSON schema (issue 24's target: <= 10% at 64 requests).

Prompts are random token ids (``--input-len``); both runs generate ``--output-len``
tokens per request (``ignore_eos``; the default schema, an array of at least 1,000
integers, cannot finish within the run, so every step is constrained).  The schema is
compiled in a warm-up run first, so the figure is the per-step cost (mask fill on the
host, mask applied on the device), not compilation.  TPOT = (T(output_len) - T(1)) /
(output_len - 1), T the wall time of the whole batch, best of ``--repeats`` (the kinds interleaved).

``--dummy llama3-8b`` benchmarks that shape with random weights and the default model's
tokenizer (xgrammar pads its vocabulary to the model's 128,256): issue 24's H200 target.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, engine_summary, summary_line, w4
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 1000}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64,
                   help="Concurrent requests (one batch).")
    p.add_argument("--input-len", type=int, default=128, help="Prompt tokens.")
    p.add_argument("--output-len", type=int, default=64, help="Tokens per request.")
    p.add_argument("--schema", default=None,
                   help="JSON schema (text or @FILE) shared by every request "
                        "(default: an array of at least 1,000 integers).")
    p.add_argument("--repeats", type=int, default=2,
                   help="Timed runs of each length and kind; the best is kept.")
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="A named model shape with random weights (implies --load-format "
                        "dummy) and the default model's tokenizer.")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


def _schema(arg: str | None) -> dict[str, Any]:
    if arg is None:
        return DEFAULT_SCHEMA
    text = open(arg[1:]).read() if arg.startswith("@") else arg
    return json.loads(text)


def _timed(llm: Any, prompts: list[list[int]], n: int,
           schema: dict[str, Any] | None) -> float:
    from pagedllm import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False,
                        structured_outputs=so)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    schema = _schema(args.schema)
    if args.dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model
        from pagedllm.models.resolve import default_model_path

        args.model, args.load_format = write_dummy_model(args.dummy), "dummy"
        args.tokenizer = args.tokenizer or default_model_path()
    eargs = engine_args_from_cli(args)
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    hi = min(llm.llm_engine.config.model_config.vocab_size, 40000)
    prompts = [w4(seed, hi, args.input_len) for seed in range(args.num_prompts)]
    for sch in (None, schema):  # warm-up, and the schema's compilation
        _timed(llm, prompts[:4], 4, sch)
    # Interleaved (plain, schema, plain, schema, ...) so that drift in the machine's
    # load hits both kinds alike; the best of the repeats is kept.
    kinds = (("plain", None), ("json_schema", schema))
    times: dict[str, dict[int, list[float]]] = {k: {1: [], args.output_len: []}
                                                 for k, _ in kinds}
    for _ in range(args.repeats):
        for n in (1, args.output_len):
            for kind, sch in kinds:
                times[kind][n].append(_timed(llm, prompts, n, sch))
    res: dict[str, Any] = {}
    for kind, _ in kinds:
        t1, tn = min(times[kind][1]), min(times[kind][args.output_len])
        res[kind] = {"t1_s": t1, "tn_s": tn,
                     "tpot_ms": 1000 * (tn - t1) / (args.output_len - 1)}
    overhead = res["json_schema"]["tpot_ms"] / res["plain"]["tpot_ms"] - 1
    res.update(num_prompts=args.num_prompts, input_len=args.input_len,
               output_len=args.output_len, tpot_overhead=overhead, schema=schema,
               device=llm.llm_engine.config.device_config.device,
               date=time.strftime("%Y-%m-%d"), **engine_summary(llm))
    print(summary_line(res))
    print(f"{'':12} {'T(1) s':>8} {f'T({args.output_len}) s':>9} {'TPOT ms':>9}")
    for kind in ("plain", "json_schema"):
        r = res[kind]
        print(f"{kind:12} {r['t1_s']:8.3f} {r['tn_s']:9.3f} {r['tpot_ms']:9.2f}")
    print(f"structured-decoding TPOT overhead at {args.num_prompts} concurrent: "
          f"{100 * overhead:+.1f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
