"""Structured-decoding overhead: TPOT of N concurrent requests with and without one
shared JSON schema (issue 24's target: <= 10% at 64 requests).

Prompts are random token ids (``--input-len``); both runs generate ``--output-len``
tokens per request (``ignore_eos``; the default schema, an array of at least 1,000
integers, cannot finish within the run, so every step is constrained).  The schema is
compiled in a warm-up run first, so the figure is the per-step cost (mask fill on the
host, mask applied on the device), not compilation.  TPOT = (T(output_len) - T(1)) /
(output_len - 1), T the wall time of the whole batch, best of ``--repeats`` (the kinds interleaved).

``--dummy llama3-8b`` benchmarks that shape with random weights and the default model's
tokenizer (49,152 tokens; the model's other 79,104 ids are padding no grammar allows):
issue 24's H200 target.

Also reported, to say where a difference comes from: the engine core's step trace
(``PAGEDLLM_STEP_TRACE``; medians over the timed runs' decode steps of scheduling,
launching -- for the schema this includes waiting for the previous step's tokens and
the grammar work --, waiting and updating; a plain run's "wait" is the device's slack
over the host), the runner's grammar host time per step (matcher advance, bitmask fill)
and the compile time of a typical (tool-call-like) schema: first, and cached (issue
24's target: <= 5 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.benchmarks.workloads import (
    DUMMY_CONFIGS,
    engine_summary,
    inproc_runner,
    summary_line,
    w4,
)
from pagedllm.engine.step_trace import TraceFile
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 1000}
# A typical schema for the compile-time figure: a tool call's arguments.
TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
    "properties": {
        "name": {"enum": ["get_weather", "get_time", "search"]},
        "arguments": {"type": "object", "additionalProperties": False,
                      "required": ["city", "unit", "days"], "properties": {
                          "city": {"type": "string", "maxLength": 32},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "tags": {"type": "array", "items": {"type": "string",
                                                              "maxLength": 12},
                                   "maxItems": 4}}}}}
TRACE_FIELDS = ("sched_ms", "launch_ms", "wait_ms", "update_ms")


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


def _timed(llm: Any, prompts: list[list[int]], n: int, schema: dict[str, Any] | None,
           keep: list[Any] | None = None) -> tuple[float, float, float]:
    """(seconds, wall-clock start, end) of one batch of ``n`` tokens per request (the
    outputs replace ``keep``'s contents when given)."""
    from pagedllm import SamplingParams
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False,
                        structured_outputs=so)
    llm.reset_prefix_cache()
    w0, t0 = time.time(), time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt, w1 = time.perf_counter() - t0, time.time()
    if keep is not None:
        keep[:] = outs
    return dt, w0, w1


def _invalid_outputs(llm: Any, schema: dict[str, Any], outs: list[Any]) -> int:
    """How many outputs a fresh matcher of ``schema`` rejects a token of (the mask
    must have kept every sampled token inside the grammar)."""
    import xgrammar as xgr

    from pagedllm.structured_output.backend import GrammarCompiler
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

    tok = llm.get_tokenizer()
    comp = GrammarCompiler(lambda: tok, llm.llm_engine.config.model_config.vocab_size)
    compiled = comp.compile(SO(json=schema))
    comp.shutdown()
    bad = 0
    for o in outs:
        m = xgr.GrammarMatcher(compiled)
        bad += not all(m.accept_token(t) for t in o.outputs[0].token_ids)
    return bad


def _trace_split(trace: list[dict[str, Any]], spans: list[tuple[float, float]],
                 reqs: int) -> dict[str, float]:
    """Median step-trace fields of the decode steps (every request, one token each)
    that began within ``spans``."""
    rows: dict[str, list[float]] = {f: [] for f in TRACE_FIELDS}
    for r in trace:
        if r["reqs"] == reqs and r["tokens"] == reqs and any(
                a <= r["t"] <= b for a, b in spans):
            for k in TRACE_FIELDS:
                rows[k].append(r[k])
    return {k: statistics.median(v) for k, v in rows.items() if v}


def _grammar_batch(llm: Any) -> Any:
    """The runner's ``GrammarBatch`` when the engine runs in this process, else None."""
    grammar = getattr(inproc_runner(llm), "grammar", None)
    return getattr(grammar, "_grammars", None)


def _compile_times(llm: Any) -> dict[str, float]:
    """First compile of :data:`TYPICAL_SCHEMA` and the median of 50 cached ones (an
    equal schema in a new object each time: the cache's key is the canonical text), ms,
    through the engine's compiler class on the engine's tokenizer."""
    from pagedllm.structured_output.backend import GrammarCompiler
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

    tok = llm.get_tokenizer()
    comp = GrammarCompiler(lambda: tok, llm.llm_engine.config.model_config.vocab_size)
    comp.compile(SO(json_object=True))  # the tokenizer's tables, once per engine
    t0 = time.perf_counter()
    comp.compile(SO(json=TYPICAL_SCHEMA))
    first = (time.perf_counter() - t0) * 1e3
    hits = []
    for _ in range(50):
        t0 = time.perf_counter()
        comp.compile(SO(json=json.loads(json.dumps(TYPICAL_SCHEMA))))
        hits.append((time.perf_counter() - t0) * 1e3)
    comp.shutdown()
    return {"first_ms": first, "cached_median_ms": statistics.median(hits),
            "cached_max_ms": max(hits)}


def main(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    schema = _schema(args.schema)
    if args.dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model
        from pagedllm.model_files.resolve import default_model_path

        args.model, args.load_format = write_dummy_model(args.dummy), "dummy"
        args.tokenizer = args.tokenizer or default_model_path()
    eargs = engine_args_from_cli(args)
    # The engine core's step trace (host/device split), unless the caller set one.
    trace = TraceFile(prefix="structured-trace-")  # written by the engine core built below
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
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k, _ in kinds}
    last_outs: list[Any] = []
    gb = _grammar_batch(llm)
    g0 = (gb.advance_s, gb.fill_s, gb.num_fills) if gb is not None else None
    for _ in range(args.repeats):
        for n in (1, args.output_len):
            for kind, sch in kinds:
                dt, w0, w1 = _timed(llm, prompts, n, sch,
                                    last_outs if sch is not None else None)
                times[kind][n].append(dt)
                if n == args.output_len:
                    spans[kind].append((w0, w1))
    res: dict[str, Any] = {}
    steps_traced = trace.read()
    for kind, _ in kinds:
        t1, tn = min(times[kind][1]), min(times[kind][args.output_len])
        res[kind] = {"t1_s": t1, "tn_s": tn,
                     "tpot_ms": 1000 * (tn - t1) / (args.output_len - 1),
                     "step_trace_ms": _trace_split(steps_traced, spans[kind],
                                                   args.num_prompts)}
    if gb is not None and g0 is not None and gb.num_fills > g0[2]:
        steps = gb.num_fills - g0[2]
        res["json_schema"]["grammar_host_ms_per_step"] = {
            "advance": 1e3 * (gb.advance_s - g0[0]) / steps,
            "fill": 1e3 * (gb.fill_s - g0[1]) / steps}
    overhead = res["json_schema"]["tpot_ms"] / res["plain"]["tpot_ms"] - 1
    res.update(num_prompts=args.num_prompts, input_len=args.input_len,
               output_len=args.output_len, tpot_overhead=overhead, schema=schema,
               compile=_compile_times(llm),
               invalid_outputs=_invalid_outputs(llm, schema, last_outs),
               device=llm.llm_engine.config.device_config.device,
               date=time.strftime("%Y-%m-%d"), **engine_summary(llm))
    trace.close()
    print(summary_line(res))
    print(f"{'':12} {'T(1) s':>8} {f'T({args.output_len}) s':>9} {'TPOT ms':>9}  "
          "decode step, median ms: sched / launch / wait / update")
    for kind in ("plain", "json_schema"):
        r = res[kind]
        split = " / ".join(f"{r['step_trace_ms'].get(k, float('nan')):.3f}"
                           for k in TRACE_FIELDS)
        print(f"{kind:12} {r['t1_s']:8.3f} {r['tn_s']:9.3f} {r['tpot_ms']:9.2f}  {split}")
    g = res["json_schema"].get("grammar_host_ms_per_step")
    if g:
        print(f"grammar host work per step: advance {g['advance']:.3f} ms, "
              f"fill {g['fill']:.3f} ms")
    c = res["compile"]
    print(f"typical schema compile: first {c['first_ms']:.1f} ms, cached median "
          f"{c['cached_median_ms']:.3f} ms (max {c['cached_max_ms']:.3f}; target <= 5 ms)")
    print(f"json_schema outputs a fresh matcher rejects: {res['invalid_outputs']} of "
          f"{len(last_outs)}")
    print(f"structured-decoding TPOT overhead at {args.num_prompts} concurrent: "
          f"{100 * overhead:+.1f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if res["invalid_outputs"] else 0
