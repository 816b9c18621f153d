"""Where did the slowest first tokens of a W2 run go?  Lines up the client's per-request
send times (``pagedllm bench serve --save-detailed``) with the engine core's step trace
(``PAGEDLLM_STEP_TRACE``), both wall clocks of one host.

For each request it finds the step that scheduled its prompt (the first step at or after
the send time whose prompt chunks include the prompt's length; unambiguous enough for
random W1 lengths; with a prefix-cache hit, the first step with a chunk shorter by whole
blocks, a guess) and splits TTFT into:

* ``to_core``: send -> the first step that began after the send (HTTP, API process,
  IPC, and the step already running when the request arrived);
* ``queued``: that step -> the step that scheduled the prompt (waiting for a slot or
  budget);
* ``prefill``: the prompt's step -> the end of the step after it (with async scheduling
  a step's tokens are read back while the next one runs);
* ``deliver``: the rest (output processing, streaming, the client's own event loop).

Usage: python benchmarks/w2_tail.py bench.json trace.jsonl [--top 12]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12, help="Slowest requests to list.")
    ap.add_argument("--block-size", type=int, default=16,
                    help="KV block size: with a prefix-cache hit a prompt's chunk is its "
                         "length minus whole blocks (then the match is a guess).")
    args = ap.parse_args()
    b = json.load(open(args.bench_json))
    steps = [json.loads(line) for line in open(args.trace)]
    steps.sort(key=lambda s: s["t"])
    starts = [s["t"] for s in steps]
    gaps = [(b2 - a) * 1e3 for a, b2 in zip(starts, starts[1:])]  # step k -> k + 1, ms

    def prompt_step(first: int, plen: int) -> int | None:
        """The step that ran the prompt: its whole length as one chunk, else (a prefix-
        cache hit) a chunk shorter by whole blocks."""
        for fits in (lambda c: c == plen,
                     lambda c: c < plen and (plen - c) % args.block_size == 0):
            j = next((k for k in range(first, len(steps))
                      if any(fits(c) for c in steps[k]["chunks"])), None)
            if j is not None:
                return j
        return None

    rows = []
    t_first = min(b["start_times"])
    for send, ttft, plen in zip(b["start_times"], b["ttfts"], b["input_lens"]):
        if not ttft:
            continue
        first = bisect.bisect_left(starts, send)
        j = prompt_step(first, plen)
        if j is None or j + 2 >= len(steps):
            continue
        done = starts[j + 2]  # the step after the prompt's has returned its tokens
        end = send + ttft
        rows.append({"ttft": ttft * 1e3, "plen": plen, "at": send - t_first,
                     "to_core": (starts[first] - send) * 1e3,
                     "queued": (starts[j] - starts[first]) * 1e3,
                     "prefill": (done - starts[j]) * 1e3,
                     "deliver": (end - done) * 1e3,
                     "step_tokens": steps[j]["tokens"], "step_reqs": steps[j]["reqs"],
                     "gap_max": max(gaps[first:j + 2])})
    if not rows:
        raise SystemExit("no request could be matched to a step")
    rows.sort(key=lambda r: r["ttft"])
    print(f"{len(rows)} of {len(b['ttfts'])} requests matched; {len(steps)} steps")
    keys = ("ttft", "to_core", "queued", "prefill", "deliver")
    for name, sel in (("all (median)", rows),
                      ("slowest 5% (median)", rows[-max(1, len(rows) // 20):])):
        print(f"{name:<22}" + "".join(
            f"{k} {statistics.median(r[k] for r in sel):7.1f}  " for k in keys))
    print(f"\n{'ttft':>7} {'to_core':>8} {'queued':>7} {'prefill':>8} {'deliver':>8} "
          f"{'plen':>5} {'step tok':>8} {'reqs':>5} {'max gap':>8} {'sent at':>8}   (ms; s)")
    for r in rows[-args.top:]:
        print(f"{r['ttft']:7.1f} {r['to_core']:8.1f} {r['queued']:7.1f} {r['prefill']:8.1f} "
              f"{r['deliver']:8.1f} {r['plen']:5d} {r['step_tokens']:8d} {r['step_reqs']:5d} "
              f"{r['gap_max']:8.1f} {r['at']:8.2f}")
    durs = sorted(gaps)
    print(f"\nstep start-to-start (ms): p50 {durs[len(durs) // 2]:.1f}  "
          f"p99 {durs[int(len(durs) * 0.99)]:.1f}  max {durs[-1]:.1f}")
    for k in sorted(range(len(gaps)), key=lambda k: -gaps[k])[:5]:
        print("  slow step:", {key: steps[k][key] for key in (
            "sched_ms", "launch_ms", "wait_ms", "update_ms", "tokens", "reqs")})

if __name__ == "__main__":
    main()
