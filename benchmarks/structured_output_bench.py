"""What structured outputs cost: grammar compile time, the per-step bitmask work, and
(on a GPU) TPOT with and without one shared JSON schema.

    python benchmarks/structured_output_bench.py compile        # CPU is fine
    python benchmarks/structured_output_bench.py mask --rows 64  # CPU or GPU
    python benchmarks/structured_output_bench.py engine          # the H200 target

``compile``: the first compile of a typical schema (a tool-call-like object with nested
properties, enums, bounded strings and arrays) on the default model's tokenizer, then
the same schema again (the cache), and the median of 20 distinct schemas (cold).
``mask``: for ``--rows`` requests decoding the ``LONG`` schema (random allowed tokens,
as greedy decoding of random weights picks them), the host time per step to fill the
bitmask and to advance every matcher, per request and batched (``GrammarBatch``, what
the runner does), and to apply the mask to ``[rows, V]`` logits (``apply_bitmask_``,
xgrammar's kernel; GPU timed with events).
``engine``: ``--num-prompts`` (64) concurrent requests on the dummy Llama-3-8B shape
(``write_dummy_model``, tokenizer: the default model's, padded to the 128k vocabulary),
``--output-len`` tokens each, unconstrained vs one shared schema that cannot finish
early (an array of at least 1,000 integers); TPOT = (T(output_len) - T(1)) /
(output_len - 1).  Target (issue 24): the schema costs <= 10% TPOT, cached compile <= 5 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pagedllm.benchmarks.structured import DEFAULT_SCHEMA, TYPICAL_SCHEMA

# The typical (tool-call-like) and the long schema of ``pagedllm bench structured``.
SCHEMA: dict[str, Any] = TYPICAL_SCHEMA
LONG: dict[str, Any] = DEFAULT_SCHEMA


TOKENIZER: str | None = None  # --tokenizer: a saved tokenizer directory


def _tokenizer() -> Any:
    import os

    from transformers import AutoTokenizer

    from pagedllm.model_files.resolve import default_model_path

    if TOKENIZER:
        return AutoTokenizer.from_pretrained(TOKENIZER)
    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                         gguf_file=os.path.basename(path))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bench_compile(vocab: int | None) -> None:
    from pagedllm.structured_output.backend import GrammarCompiler
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

    tok = _tokenizer()
    comp = GrammarCompiler(lambda: tok, vocab or len(tok))
    t0 = time.perf_counter()
    comp.compile(SO(json_object=True))  # builds the TokenizerInfo once
    print(f"tokenizer info + json_object grammar: {_ms(t0):.1f} ms")
    t0 = time.perf_counter()
    comp.compile(SO(json=SCHEMA))
    first = _ms(t0)
    hits = []
    for _ in range(50):
        t0 = time.perf_counter()
        comp.compile(SO(json=dict(SCHEMA)))  # an equal schema, a new object: cache key
        hits.append(_ms(t0))
    cold = []
    for i in range(20):
        s = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                      f"extra{i}": {"type": "integer"}}}
        t0 = time.perf_counter()
        comp.compile(SO(json=s))
        cold.append(_ms(t0))
    print(f"typical schema: first compile {first:.1f} ms; cached median "
          f"{statistics.median(hits):.3f} ms (max {max(hits):.3f}); 20 distinct schemas "
          f"median {statistics.median(cold):.1f} ms")


def bench_mask(rows: int, vocab: int | None, device: str, steps: int = 40) -> None:
    """Host time per step of the grammar work for ``rows`` requests of the ``LONG``
    schema (what ``pagedllm bench structured`` decodes): each step fills the bitmask,
    then every row takes a random allowed token (as greedy decoding of random weights
    does) and advances.  The runner's batched path (``GrammarBatch``) against the
    per-request one (``fill_bitmask`` / ``GrammarState.advance``) on identical states;
    wall and process-CPU time (the latter counts xgrammar's fill threads too)."""
    import random

    import numpy as np

    from pagedllm.sample.token_constraints import apply_bitmask_
    from pagedllm.structured_output.backend import GrammarCompiler
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO
    from pagedllm.worker.structured_output.batch import GrammarBatch
    from pagedllm.worker.structured_output.matcher import GrammarState, fill_bitmask

    tok = _tokenizer()
    v = vocab or len(tok)
    compiled = GrammarCompiler(lambda: tok, v).compile(SO(json=LONG))
    eos = [tok.eos_token_id]
    ref = [GrammarState(compiled, eos) for _ in range(rows)]
    bat = [GrammarState(compiled, eos) for _ in range(rows)]
    gb = GrammarBatch()
    out = torch.empty(rows, -(-v // 32), dtype=torch.int32)
    rng = random.Random(0)
    t: dict[str, list[float]] = {k: [] for k in ("fill", "fill_cpu", "adv", "bfill",
                                                "bfill_cpu", "badv")}

    def timed(key: str, fn: Any) -> Any:
        w, c = time.perf_counter(), time.process_time()
        r = fn()
        t[key].append(_ms(w))
        if key + "_cpu" in t:
            t[key + "_cpu"].append((time.process_time() - c) * 1e3)
        return r

    for _ in range(steps):
        mask = timed("fill", lambda: fill_bitmask(ref, v))
        got = timed("bfill", lambda: gb.fill(bat, out))
        assert torch.equal(got, mask)
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :v]
        toks = [rng.choice(np.flatnonzero(b).tolist()) for b in bits]
        timed("adv", lambda toks=toks: [st.advance(x) for st, x in zip(ref, toks)])
        timed("badv", lambda toks=toks: gb.advance(bat, toks))
    dev = torch.device(device)
    logits = torch.randn(rows, v, device=dev)
    m = mask.to(dev)
    times = []
    for _ in range(30):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            apply_bitmask_(logits, m)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            apply_bitmask_(logits, m)
            times.append(_ms(t0))
    med = {k: statistics.median(x[5:]) for k, x in t.items()}
    print(f"{rows} rows of the LONG schema, vocab {v} (tokenizer {len(tok)}), median ms per "
          f"step over {steps - 5}:")
    print(f"  per request: fill {med['fill']:.3f} (cpu {med['fill_cpu']:.3f}), "
          f"advance {med['adv']:.3f}")
    print(f"  batched    : fill {med['bfill']:.3f} (cpu {med['bfill_cpu']:.3f}), "
          f"advance {med['badv']:.3f}")
    print(f"  apply_bitmask on {device}: {statistics.median(times[5:]):.3f}")


def bench_engine(num_prompts: int, input_len: int, output_len: int) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.workloads import write_dummy_model
    from pagedllm.model_files.resolve import default_model_path
    from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

    llm = LLM(write_dummy_model("llama3-8b"), load_format="dummy",
              tokenizer=default_model_path())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 40000, (input_len,), generator=g).tolist()
               for _ in range(num_prompts)]

    def run(n: int, so: SO | None) -> float:
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False,
                           structured_outputs=so)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False)
        return time.perf_counter() - t0

    for so in (None, SO(json=LONG)):  # warm-up, and the schema's first compile
        run(4, so)
    res = {}
    for name, so in (("plain", None), ("schema", SO(json=LONG))):
        t1 = min(run(1, so) for _ in range(2))
        tn = min(run(output_len, so) for _ in range(2))
        res[name] = (tn - t1) / (output_len - 1) * 1e3
        print(f"{name}: T(1) {t1:.3f} s, T({output_len}) {tn:.3f} s, TPOT "
              f"{res[name]:.2f} ms")
    print(f"structured output TPOT cost at {num_prompts} concurrent: "
          f"{(res['schema'] / res['plain'] - 1) * 100:+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["compile", "mask", "engine"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=None,
                    help="pad the tokenizer's vocabulary to this size (128256: Llama 3)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", default=None,
                    help="a saved tokenizer directory (default: the default model's)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    global TOKENIZER
    TOKENIZER = a.tokenizer
    if a.part == "compile":
        bench_compile(a.vocab)
    elif a.part == "mask":
        bench_mask(a.rows, a.vocab, a.device)
    else:
        bench_engine(a.num_prompts, a.input_len, a.output_len)


if __name__ == "__main__":
    main()
