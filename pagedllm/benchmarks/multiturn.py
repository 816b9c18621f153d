"""Multi-turn chat (issue 45): TTFT and throughput with the prefix cache's host tier off / on.

``--num-conversations`` conversations of ``--turns`` turns each: a conversation starts
with a ``--history-len``-token history, and every turn sends the whole conversation so
far (the last answer included) plus ``--turn-min``..``--turn-max`` new tokens, and
generates ``--output-len`` tokens.  Turns are issued round-robin over the conversations
(turn 1 of every conversation, then turn 2, ...), at most ``--max-concurrency`` at once,
and a conversation's next turn waits for its previous answer -- so by the time a
conversation comes back, the others have pushed its history out of a device KV pool
smaller than the working set (limit it with ``--kv-cache-memory-bytes``).

With ``--kv-offload-size`` > 0 the workload runs twice on fresh engines, the host tier
off and then on (``--only`` picks one), and reports for each: TTFT p50/p99 (submission
to first token), output and total token throughput, and the prompt tokens served from
the prefix cache (any tier; ``--kv-offload-disk-size`` adds the disk tier behind the
host's in the "on" run).  Token ids are random (``--seed``), so ``--dummy`` shapes
(dummy weights) work as well as real models.  The scheduling policy is the server's
default, fcfs, unless ``--scheduling-policy`` names another.

    pagedllm bench multiturn --dummy llama3-8b --kv-cache-memory-bytes 8e9 \\
        --kv-offload-size 64 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, engine_summary, summary_line
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-conversations", type=int, default=600)
    p.add_argument("--turns", type=int, default=4, help="Turns per conversation.")
    p.add_argument("--history-len", type=int, default=1500,
                   help="Tokens of a conversation's history before its first turn.")
    p.add_argument("--turn-min", type=int, default=200,
                   help="Fewest new tokens a turn adds (uniform in [min, max]).")
    p.add_argument("--turn-max", type=int, default=400)
    p.add_argument("--output-len", type=int, default=64, help="Tokens generated a turn.")
    p.add_argument("--max-concurrency", type=int, default=64,
                   help="Turns in flight at once.")
    p.add_argument("--only", choices=["off", "on"], default=None,
                   help="Run with the host tier off or on only (default: both, when "
                        "--kv-offload-size > 0).")
    p.add_argument("--vocab-hi", type=int, default=None,
                   help="Upper bound of random token ids (default: min(vocab, 128000)).")
    p.add_argument("--dummy", default=None, choices=sorted(DUMMY_CONFIGS),
                   help="Benchmark a named model shape with random weights (implies "
                        "--load-format dummy).")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


@dataclass
class Conversation:
    """One conversation's token history and the turns still to send."""

    tokens: list[int]
    new_turns: list[list[int]]
    done: int = 0  # turns answered
    busy: bool = False


@dataclass
class _Turn:
    conv: int
    submitted: float
    prompt_len: int
    first: float | None = None


@dataclass
class RunResult:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        q = statistics.quantiles(self.ttft_s, n=100, method="inclusive") \
            if len(self.ttft_s) > 1 else self.ttft_s * 99
        return {
            "turns": len(self.ttft_s), "wall_s": self.wall_s,
            "ttft_p50_ms": 1000 * statistics.median(self.ttft_s),
            "ttft_p99_ms": 1000 * q[98],
            "output_tok_s": self.output_tokens / self.wall_s,
            "total_tok_s": (self.prompt_tokens + self.output_tokens) / self.wall_s,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_fraction": self.cached_tokens / max(1, self.prompt_tokens)}


def make_conversations(args: argparse.Namespace, vocab_hi: int) -> list[Conversation]:
    """The workload, the same for every run (seeded by ``--seed``)."""
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, vocab_hi) for _ in range(n)]

    return [Conversation(toks(args.history_len),
                         [toks(rng.randint(args.turn_min, args.turn_max))
                          for _ in range(args.turns)])
            for _ in range(args.num_conversations)]


def longest_prompt(args: argparse.Namespace) -> int:
    return args.history_len + args.turns * args.turn_max + (args.turns - 1) * args.output_len


def run_workload(engine: Any, convs: list[Conversation], output_len: int,
                 max_concurrency: int) -> RunResult:
    """Drive ``engine`` (an ``LLMEngine``) through every turn of ``convs``, round-robin."""
    from pagedllm import SamplingParams
    from pagedllm.engine.output_processor import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    order = deque((c, t) for t in range(len(convs[0].new_turns)) for c in range(len(convs)))
    inflight: dict[str, _Turn] = {}
    res = RunResult()
    t0 = time.perf_counter()
    while order or inflight:
        while order and len(inflight) < max_concurrency:
            c, t = order[0]
            conv = convs[c]
            if conv.busy or conv.done < t:
                break  # strict round-robin: its previous answer is not back yet
            order.popleft()
            conv.tokens = conv.tokens + conv.new_turns[t]
            conv.busy = True
            rid = f"c{c}t{t}"
            inflight[rid] = _Turn(c, time.perf_counter(), len(conv.tokens))
            engine.add_request(rid, {"prompt_token_ids": conv.tokens}, sp,
                               kind=RequestOutputKind.DELTA)
        for out in engine.step():
            turn = inflight.get(out.request_id)
            if turn is None:
                continue
            conv = convs[turn.conv]
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new and turn.first is None:
                turn.first = time.perf_counter()
            conv.tokens = conv.tokens + new
            if out.finished:
                del inflight[out.request_id]
                conv.busy, conv.done = False, conv.done + 1
                res.ttft_s.append((turn.first or time.perf_counter()) - turn.submitted)
                res.prompt_tokens += turn.prompt_len
                res.output_tokens += output_len
                res.cached_tokens += max(0, out.num_cached_tokens or 0)
    res.wall_s = time.perf_counter() - t0
    return res


def _one_run(args: argparse.Namespace, offload_bytes: int) -> dict[str, Any]:
    from pagedllm import LLM

    eargs = engine_args_from_cli(args)
    if eargs.scheduling_policy is None:
        # Chat turns are served traffic: the server's default policy, not the offline
        # LLM's "throughput" (on CUDA), which paces prompts over the decode horizon
        # and so sets TTFT by pacing rather than by what the prefix cache saves.
        eargs.scheduling_policy = "fcfs"
    eargs.kv_offload_bytes = offload_bytes
    if not offload_bytes:  # "off": no tier at all (the disk tier sits behind the host's)
        eargs.kv_offload_disk_bytes = 0
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    try:
        vocab = llm.llm_engine.config.model_config.vocab_size
        convs = make_conversations(args, args.vocab_hi or min(vocab, 128000))
        res = run_workload(llm.llm_engine, convs, args.output_len, args.max_concurrency)
        out = {"kv_offload_bytes": offload_bytes, **res.summary(), **engine_summary(llm)}
        tier = llm.llm_engine.client.core.scheduler.offload
        if tier is not None:
            out["host_blocks"] = tier.num_host_blocks
            if tier.disk is not None:
                out["disk_blocks"] = tier.disk.num_disk_blocks
            out["host_hit_blocks"] = tier.total_hit_blocks
        return out
    finally:
        llm.llm_engine.shutdown()


def main(args: argparse.Namespace) -> int:
    if args.dummy:
        from pagedllm.benchmarks.workloads import write_dummy_model

        args.model, args.load_format = write_dummy_model(args.dummy), "dummy"
        args.skip_tokenizer_init = True
    need = longest_prompt(args) + args.output_len
    if args.max_model_len is not None and need > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the last "
                         f"turn's {need} tokens: raise it or shorten the workload")
    size = int(args.kv_offload_size * (1 << 30))
    modes = [args.only] if args.only else (["off", "on"] if size > 0 else ["off"])
    results = [_one_run(args, size if m == "on" else 0) for m in modes]
    print(summary_line(results[0]))
    print(f"{args.num_conversations} conversations x {args.turns} turns, history "
          f"{args.history_len} + {args.turn_min}..{args.turn_max} a turn, "
          f"{args.output_len} out, concurrency {args.max_concurrency}")
    print(f"{'host tier':<10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'out tok/s':>11}"
          f"{'tot tok/s':>11}{'cached':>8}")
    for m, r in zip(modes, results):
        print(f"{m:<10}{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>13.1f}"
              f"{r['output_tok_s']:>11.1f}{r['total_tok_s']:>11.1f}"
              f"{r['cached_fraction']:>8.1%}")
    if len(results) == 2:
        off, on = results
        print(f"on/off: TTFT p50 x{on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, "
              f"throughput x{on['total_tok_s'] / off['total_tok_s']:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"modes": dict(zip(modes, results)),
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0
