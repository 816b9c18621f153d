"""Structured-decoding overhead: TPOT of N concurrent requests with and without one
shared JSON schema (issue 24's target: <= 10% at 64 requests).

Both runs generate the same number of tokens per request (``ignore_eos``; the default
schema, an array of strings, never has to end, and a finished grammar allows only the
stop tokens).  The schema is compiled in a warm-up run first, so the figure is the
per-step cost (mask fill on the host, mask applied on the device), not compilation.
TPOT per request = (last token time - first token time) / (tokens - 1); medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.benchmarks.workloads import engine_summary, summary_line
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

DEFAULT_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
PROMPT = "Write a long JSON array of English words about {}:"
TOPICS = ["the sea", "cooking", "trains", "music", "stars", "forests", "cities", "maths"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64,
                   help="Concurrent requests (one batch).")
    p.add_argument("--output-len", type=int, default=64, help="Tokens per request.")
    p.add_argument("--schema", default=None,
                   help="JSON schema (text or @FILE) shared by every request "
                        "(default: an array of strings).")
    p.add_argument("--repeats", type=int, default=2,
                   help="Timed runs of each kind (alternating); the best is kept.")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


def _schema(arg: str | None) -> dict[str, Any]:
    if arg is None:
        return DEFAULT_SCHEMA
    text = open(arg[1:]).read() if arg.startswith("@") else arg
    return json.loads(text)


def _run(llm: Any, prompts: list[str], output_len: int,
         schema: dict[str, Any] | None) -> dict[str, float]:
    from pagedllm import SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len,
                        structured_outputs=so)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tpot = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and m.first_token_time and m.last_token_time and n > 1:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
    return {"tpot_ms": 1000 * statistics.median(tpot),
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall}


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    schema = _schema(args.schema)
    eargs = engine_args_from_cli(args)
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    prompts = [PROMPT.format(TOPICS[i % len(TOPICS)]) + " " * (i // len(TOPICS))
               for i in range(args.num_prompts)]
    _run(llm, prompts[:4], 8, None)  # warm-up, and the schema's compilation
    _run(llm, prompts[:4], 8, schema)
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for kind, sch in (("plain", None), ("json_schema", schema)):
            llm.reset_prefix_cache()
            r = _run(llm, prompts, args.output_len, sch)
            if kind not in best or r["tpot_ms"] < best[kind]["tpot_ms"]:
                best[kind] = r
    overhead = best["json_schema"]["tpot_ms"] / best["plain"]["tpot_ms"] - 1
    res = {"num_prompts": args.num_prompts, "output_len": args.output_len,
           "plain": best["plain"], "json_schema": best["json_schema"],
           "tpot_overhead": overhead, "schema": schema,
           "device": llm.llm_engine.config.device_config.device,
           "date": time.strftime("%Y-%m-%d"), **engine_summary(llm)}
    print(summary_line(res))
    print(f"{'':12} {'TPOT ms':>9} {'tok/s':>9}")
    for kind in ("plain", "json_schema"):
        print(f"{kind:12} {best[kind]['tpot_ms']:9.2f} {best[kind]['tok_s']:9.1f}")
    print(f"structured-decoding TPOT overhead: {100 * overhead:+.1f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
