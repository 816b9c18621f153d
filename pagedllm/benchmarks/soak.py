"""Soak test: a bounded, seeded mix of valid, invalid, cancelled and timed-out requests
against a real server, watching its memory and KV cache (``pagedllm bench soak``).

::

    pagedllm bench soak --duration 1800 --seed 0 --concurrency 4       # starts a server
    pagedllm bench soak --base-url http://127.0.0.1:8000 --pid 1234    # or load one

``--concurrency`` workers each send requests back to back, drawing the kind and the
request from ``random.Random(seed + worker)`` (mix: ``soak_traffic.MIX``).  Every
``--sample-interval`` seconds the sampler records the resident memory (psutil) of the
server process and its children (the engine core) and the KV gauges of ``/metrics``.
After ``--duration`` seconds the workers stop, the server gets ``--drain-timeout``
seconds to go idle, and the run fails (exit 1) when any of these holds:

* a request failed: a 5xx other than 503, a transport error on a request the client did
  not abandon, a valid request refused or an invalid one accepted (``soak_traffic``);
* resident memory grew more than ``--max-rss-growth-mb`` (default 100 MB) from the end
  of the warm-up (``--warmup`` seconds) to after the drain, summed over the processes;
* KV blocks are still in use, or requests still running/waiting, after the drain.

The summary (``--output`` writes it as JSON too) gives requests by kind and outcome, the
first failures, RSS at the end of warm-up / after drain / peak per process, and the KV
state after drain.  Figures belong in ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SERVE_ARGS = "--max-model-len 256 --max-num-seqs 8"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0,
                   help="Seconds of traffic (the drain comes after). Default 60.")
    p.add_argument("--seed", type=int, default=0,
                   help="Worker i draws its requests from random.Random(seed + i).")
    p.add_argument("--concurrency", type=int, default=4,
                   help="Concurrent clients, each sending requests back to back.")
    p.add_argument("--base-url", default=None,
                   help="Soak this running server instead of starting one.")
    p.add_argument("--pid", type=int, default=None,
                   help="With --base-url: the server's pid, to sample its RSS (and its "
                        "children's); without it memory is not checked.")
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS,
                   help="Arguments of the `pagedllm serve` it starts (host and port are "
                        f"its own). Default: {DEFAULT_SERVE_ARGS!r}.")
    p.add_argument("--warmup", type=float, default=None,
                   help="Seconds before the RSS baseline is taken (default: 20%% of "
                        "--duration, between 10 and 120).")
    p.add_argument("--max-rss-growth-mb", type=float, default=100.0,
                   help="Fail if RSS grows more than this after warm-up (MB).")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="Seconds the server gets to finish and free every KV block.")
    p.add_argument("--sample-interval", type=float, default=2.0,
                   help="Seconds between RSS / KV samples.")
    p.add_argument("--output", default=None, help="Also write the summary here (JSON).")


# ---------------------------------------------------------------------- the server


class _Server:
    """``pagedllm serve`` on 127.0.0.1, port 0, log in a temp file (for the summary)."""

    def __init__(self, serve_args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-soak-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host",
             "127.0.0.1", "--port", "0", *shlex.split(serve_args)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_url(self, timeout: float = 600.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; "
                                   f"log: {self.log.name}")
            with open(self.log.name, encoding="utf-8", errors="replace") as f:
                m = re.search(r"Serving on (http://[\d.]+:\d+)", f.read())
            if m:
                return m.group(1)
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout:.0f} s; log: {self.log.name}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


# ---------------------------------------------------------------------- sampling


@dataclass
class _Sample:
    t: float
    rss: dict[str, int]  # process label -> bytes
    kv: dict[str, float]


def _rss(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, int] = {}
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            label = ("api_server" if p.pid == pid else "resource_tracker"
                     if "resource_tracker" in cmd else "engine_core"
                     if "spawn_main" in cmd else f"{p.name()}[{p.pid}]")
            out[f"{label}[{p.pid}]" if label in out else label] = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out


_KV_SERIES = ("kv_cache_usage_perc", "kv_cache_free_blocks", "kv_cache_total_blocks",
              "num_requests_running", "num_requests_waiting")


async def _kv(session: Any) -> dict[str, float]:
    async with session.get("/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        # vLLM's names for the scheduler gauges, ours (pagedllm:) for the block counts.
        m = re.match(r"(?:vllm|pagedllm):(\w+)\{[^}]*\} (\S+)$", line)
        if m and m.group(1) in _KV_SERIES:
            out[m.group(1)] = float(m.group(2))
    return out


def _idle(kv: dict[str, float]) -> bool:
    return (kv.get("num_requests_running") == 0 and kv.get("num_requests_waiting") == 0
            and kv.get("kv_cache_usage_perc") == 0
            and kv.get("kv_cache_free_blocks") == kv.get("kv_cache_total_blocks"))


# ---------------------------------------------------------------------- the run


@dataclass
class _Run:
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[dict[str, str]] = field(default_factory=list)
    samples: list[_Sample] = field(default_factory=list)


async def _soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    import aiohttp

    from pagedllm.benchmarks.soak_traffic import MIX, run_one

    run = _Run()
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    kinds, weights = list(MIX), list(MIX.values())
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url=url, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.get("/v1/models") as r:
            card = (await r.json())["data"][0]
        model, max_model_len = card["id"], int(card.get("max_model_len") or 2048)

        async def worker(i: int) -> None:
            rng = random.Random(args.seed + i)
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                o = await run_one(session, rng, kind, model, max_model_len)
                run.counts[(o.kind, o.result)] += 1
                if o.result == "failure" and len(run.failures) < 20:
                    run.failures.append({"kind": o.kind, "detail": o.detail,
                                         "at_s": f"{time.monotonic() - t0:.1f}"})

        async def sampler() -> None:
            while True:
                try:
                    kv = await _kv(session)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    kv = {}
                run.samples.append(_Sample(time.monotonic() - t0, _rss(pid), kv))
                await asyncio.sleep(args.sample_interval)

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        traffic_s = time.monotonic() - t0
        drained, kv_after = False, {}
        deadline = time.monotonic() + args.drain_timeout
        while time.monotonic() < deadline:
            kv_after = await _kv(session)
            if _idle(kv_after):
                drained = True
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(args.sample_interval)  # let the sampler see the idle server
        sampling.cancel()
        rss_after = _rss(pid)
    return _summary(args, run, traffic_s, drained, kv_after, rss_after, pid)


def _summary(args: argparse.Namespace, run: _Run, traffic_s: float, drained: bool,
             kv_after: dict[str, float], rss_after: dict[str, int],
             pid: int | None) -> dict[str, Any]:
    warmup = args.warmup if args.warmup is not None else min(120.0, max(
        10.0, 0.2 * args.duration))
    mb = 1e6
    base = next((s.rss for s in run.samples if s.t >= warmup and s.rss), None)
    rss: dict[str, Any] = {}
    growth = 0.0
    if base is not None and rss_after:
        for label in base:
            peak = max(s.rss.get(label, 0) for s in run.samples)
            rss[label] = {"after_warmup_mb": round(base[label] / mb, 1),
                          "after_drain_mb": round(rss_after.get(label, 0) / mb, 1),
                          "peak_mb": round(peak / mb, 1)}
        growth = (sum(rss_after.values()) - sum(base.values())) / mb
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, result), n in sorted(run.counts.items()):
        by_kind.setdefault(kind, {})[result] = n
    reasons = []
    n_fail = sum(n for (_, result), n in run.counts.items() if result == "failure")
    if n_fail:
        reasons.append(f"{n_fail} failed requests")
    if rss and growth > args.max_rss_growth_mb:
        reasons.append(f"RSS grew {growth:.0f} MB after warm-up "
                       f"(limit {args.max_rss_growth_mb:.0f} MB)")
    if not drained:
        reasons.append(f"not idle {args.drain_timeout:.0f} s after the traffic stopped "
                       f"(KV blocks or requests still in use: {kv_after})")
    return {
        "seed": args.seed, "concurrency": args.concurrency, "duration_s": round(traffic_s),
        "warmup_s": warmup, "requests": sum(run.counts.values()), "by_kind": by_kind,
        "failures": run.failures, "rss": rss or "not sampled (no --pid)",
        "rss_growth_mb": round(growth, 1), "kv_after_drain": kv_after,
        "passed": not reasons, "reasons": reasons,
    }


def _print(summary: dict[str, Any]) -> None:
    print(f"soak: {summary['requests']} requests in {summary['duration_s']} s "
          f"(seed {summary['seed']}, concurrency {summary['concurrency']})")
    for kind, results in summary["by_kind"].items():
        print(f"  {kind:10s} " + ", ".join(f"{r} {n}" for r, n in results.items()))
    if isinstance(summary["rss"], dict):
        for label, r in summary["rss"].items():
            print(f"  RSS {label}: {r['after_warmup_mb']} MB after warm-up, "
                  f"{r['after_drain_mb']} MB after drain, peak {r['peak_mb']} MB")
        print(f"  RSS growth after warm-up: {summary['rss_growth_mb']} MB")
    print(f"  KV after drain: {summary['kv_after_drain']}")
    for f in summary["failures"][:5]:
        print(f"  failure: {f}")
    print("PASSED" if summary["passed"] else "FAILED: " + "; ".join(summary["reasons"]))


def main(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.concurrency <= 0:
        raise ValueError("duration and concurrency must be positive")
    server = None
    url, pid = args.base_url, args.pid
    if url is None:
        server = _Server(args.serve_args)
        url, pid = server.wait_url(), server.proc.pid
        print(f"soak: started `pagedllm serve {args.serve_args}` at {url} (pid {pid}, "
              f"log {server.log.name})")
    try:
        summary = asyncio.run(_soak(args, url, pid))
    finally:
        status = server.stop() if server is not None else None
    if server is not None:
        summary["server_exit_status"] = status
        if status != 0:
            summary["passed"] = False
            summary["reasons"].append(f"server exited with status {status}")
    _print(summary)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["passed"] else 1
