"""Online serving load generator (W2): Poisson arrivals against a running server.

Open loop: request ``i`` is sent at its scheduled time whatever happened to the earlier
ones (``random.Random(arrival_seed).expovariate(rate)`` between sends), so a slow server
sees its queue grow, as in production.  Every request streams
(``stream_options.include_usage``) and the metrics follow vLLM's ``benchmark_serving``:

* TTFT: request sent -> first streamed token;
* TPOT per request: (E2E - TTFT) / (output tokens - 1);
* ITL: every gap between streamed chunks that carry tokens, pooled over requests;
* E2E: request sent -> last byte; output tok/s = completion tokens / benchmark duration.

W2 exactly (docs/benchmarks.md, 'Workloads'): ``--num-prompts 400 --request-rate
10|20|40`` with the W1 generator (seed 0) as token-id prompts, ``max_tokens = min_tokens = olen``,
``ignore_eos``, greedy.  Token ids stay below the served tokenizer's vocabulary
(``/tokenizer_info``; W2's 128000 at most) unless ``--vocab-hi`` says otherwise;
``--input-len-range``/``--output-len-range`` shrink the requests for CPU runs (the
draw order -- plen, olen, prompt -- is kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


@dataclass
class _Result:
    ok: bool = False
    status: int = 0
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0  # wall clock (time.time()) when sent: lines up with server logs
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server to load (its /v1/completions).")
    p.add_argument("--model", default=None,
                   help="Model name to send (default: the first of /v1/models).")
    p.add_argument("--api-key", default=None, help="Bearer key, if the server needs one.")
    p.add_argument("--num-prompts", type=int, default=400, help="Requests to send (W2: 400).")
    p.add_argument("--request-rate", type=float, default=10.0,
                   help="Poisson arrival rate in requests/s ('inf' sends all at once).")
    p.add_argument("--seed", type=int, default=0, help="Workload seed (W1 generator).")
    p.add_argument("--arrival-seed", type=int, default=1, help="Seed of the arrival times.")
    p.add_argument("--vocab-hi", type=int, default=None,
                   help="Upper bound of random prompt token ids. Default: 128000 (W2), "
                        "or the served tokenizer's vocabulary if smaller "
                        "(/tokenizer_info), e.g. 49152 for the default model.")
    p.add_argument("--input-len-range", type=int, nargs=2, default=[128, 1024],
                   metavar=("MIN", "MAX"), help="Prompt lengths drawn uniformly (W1).")
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 512],
                   metavar=("MIN", "MAX"), help="Output lengths drawn uniformly (W1).")
    p.add_argument("--prompt-type", choices=["token-ids", "text"], default="token-ids",
                   help="token-ids (W2), or text: the same lengths as words of plain text.")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Cap on requests in flight (default: none, pure open loop).")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Also draw the latency percentiles and the TTFT and ITL "
                        "distributions into this PNG (matplotlib; keeps the per-request "
                        "lists of --save-detailed in the results).")
    p.add_argument("--save-detailed", action="store_true",
                   help="Also write per-request lists to the JSON (as vLLM's benchmark: "
                        "input_lens, output_lens, ttfts, itls, errors; plus start_times, "
                        "the wall-clock send times, to line up with a server-side trace "
                        "such as PAGEDLLM_STEP_TRACE).")


_WORDS = ("the of and to in is was for on that with as by at from his her it an were are "
          "which this be or has had not but one all their there been they more time year "
          "city world people river music history science water light system").split()


def make_requests(args: argparse.Namespace) -> list[tuple[Any, int]]:
    """(prompt, output_len) in W1's draw order: plen, olen, then the prompt ids."""
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len_range
    lo_out, hi_out = args.output_len_range
    out: list[tuple[Any, int]] = []
    for _ in range(args.num_prompts):
        plen = rng.randint(lo_in, hi_in)
        olen = rng.randint(lo_out, hi_out)
        ids = [rng.randrange(1000, args.vocab_hi) for _ in range(plen)]
        if args.prompt_type == "text":
            out.append((" ".join(_WORDS[i % len(_WORDS)] for i in ids), olen))
        else:
            out.append((ids, olen))
    return out


async def _one(session: aiohttp.ClientSession, model: str, prompt: Any,
               olen: int) -> _Result:
    import aiohttp

    res = _Result(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    body = {"model": model, "prompt": prompt, "max_tokens": olen, "min_tokens": olen,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            # Token ids too, so that chunks count when the server has no tokenizer
            # (--skip-tokenizer-init: empty text) -- a vLLM extra like min_tokens.
            "return_token_ids": True}
    res.start = time.time()
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post("/v1/completions", json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.read()).decode(errors="replace")[:200]
                return res
            async for raw in r.content:  # one line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[len(b"data: "):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", "error"))[:200]
                    return res
                now = time.perf_counter()
                choices = chunk.get("choices")
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
        res.e2e = time.perf_counter() - t0
        res.ok = res.ttft > 0.0
        if not res.ok:
            res.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    s = sorted(values)

    def q(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(s) - 1) * p
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)

    return {"mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


async def _fit_to_model(client: aiohttp.ClientSession, args: argparse.Namespace,
                        card: dict[str, Any]) -> argparse.Namespace:
    """The arguments with ``vocab_hi`` taken from the served tokenizer when not given
    (W2's 128000 at most); a ``ValueError`` when the longest request cannot fit the
    model's ``max_model_len``."""
    import aiohttp

    vocab_hi = args.vocab_hi
    if vocab_hi is None:
        vocab_hi = 128000
        try:
            async with client.get("/tokenizer_info") as r:
                if r.status == 200:
                    size = (await r.json()).get("vocab_size")
                    if isinstance(size, int) and size > 1000:
                        vocab_hi = min(vocab_hi, size)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass  # a server without /tokenizer_info (vLLM by default): W2's range
    max_len = card.get("max_model_len")
    longest = args.input_len_range[1] + args.output_len_range[1]
    if isinstance(max_len, int) and longest > max_len:
        raise ValueError(f"input-len-range/output-len-range: the longest request "
                         f"({args.input_len_range[1]} + {args.output_len_range[1]} tokens) "
                         f"exceeds the served model's max_model_len {max_len}")
    return argparse.Namespace(**{**vars(args), "vocab_hi": vocab_hi})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: the CLI builds every subcommand's parser, so a module-level import
    # would cost `pagedllm serve` ~0.3 s of start-up for a client it does not use.
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # aiohttp, as vLLM's benchmark: it parses a streamed chunk with about half the CPU
    # of httpx, and at W2's 40 req/s the client handles ~8,000 chunks/s.
    async with aiohttp.ClientSession(
            base_url=args.base_url, headers=headers, read_bufsize=1 << 20,
            timeout=aiohttp.ClientTimeout(total=args.timeout),
            connector=aiohttp.TCPConnector(limit=0)) as client:
        try:
            async with client.get("/v1/models") as r:
                r.raise_for_status()
                cards = (await r.json())["data"]
                model = args.model or cards[0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError) as e:
            raise ValueError(f"base-url: cannot list the models of {args.base_url} "
                             f"({type(e).__name__}: {e})") from None
        args = await _fit_to_model(client, args, next(
            (c for c in cards if c.get("id") == model), {}))
        reqs = make_requests(args)
        arrivals = random.Random(args.arrival_seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: Any, olen: int) -> _Result:
            if sem is None:
                return await _one(client, model, prompt, olen)
            async with sem:
                return await _one(client, model, prompt, olen)

        # One untimed request first, as vLLM's benchmark does: it checks that the server
        # answers at all, and the first request's one-time costs on both sides (lazy
        # imports, connection set-up) stay out of the measured tail.
        warm = await _one(client, model, reqs[0][0], min(reqs[0][1], 16))
        if not warm.ok:
            raise ValueError(f"the warm-up request failed: {warm.error or warm.status}")
        tasks = []
        cpu0 = time.process_time()
        start = time.perf_counter()
        next_at = start
        for prompt, olen in reqs:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt, olen)))
            if not math.isinf(args.request_rate):
                next_at += arrivals.expovariate(args.request_rate)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model, "base_url": args.base_url, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate, "duration_s": duration,
        "completed": len(ok), "failed": len(results) - len(ok),
        "failure_statuses": sorted({r.status for r in results if not r.ok}),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        # This client's own CPU time: near the duration means one core is saturated and
        # the latencies it measures include its own queueing.
        "client_cpu_s": client_cpu,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": _pcts([r.ttft for r in ok]), "tpot_s": _pcts(tpots),
        "itl_s": _pcts([x for r in ok for x in r.itl]), "e2e_s": _pcts([r.e2e for r in ok]),
        "errors": [asdict(r) | {"itl": None} for r in results if not r.ok][:5],
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    if args.save_detailed or args.plot:
        summary |= {"start_times": [r.start for r in results],
                    "input_lens": [r.prompt_len for r in results],
                    "output_lens": [r.output_tokens for r in results],
                    "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                    "errors_all": [r.error for r in results]}
    return summary


def print_table(s: dict[str, Any]) -> None:
    print(f"\n==== pagedllm bench serve: {s['model']} @ {s['request_rate']} req/s ====")
    rows = [("Successful requests", f"{s['completed']}"),
            ("Failed requests", f"{s['failed']} {s['failure_statuses'] or ''}"),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", f"{s['total_input_tokens']}"),
            ("Total output tokens", f"{s['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
            ("Client CPU (% of one core)", f"{100 * s['client_cpu_s'] / s['duration_s']:.0f}")]
    for label, v in rows:
        print(f"{label:<34}{v:>16}")
    print(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = s[f"{name}_s"]
        print(f"{name.upper():<10}" + "".join(f"{d[k] * 1000:>10.1f}"
                                              for k in ("mean", "p50", "p90", "p99")))


def main(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.plot import check_plot_path

    check_plot_path(args.plot)
    if args.num_prompts < 1 or not args.request_rate > 0:
        raise ValueError("num-prompts must be >= 1 and request-rate > 0")
    summary = asyncio.run(run(args))
    print_table(summary)
    if args.plot:
        from pagedllm.benchmarks.plot import plot_serve

        plot_serve(summary, args.plot)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
