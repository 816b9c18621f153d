"""Data parallelism: two engine cores behind one ``pagedllm serve``.  Concurrent requests
(the official ``openai`` client) are spread over both engines (per-engine metrics) and
answered exactly as one engine answers; killing one engine core mid-stream is reported
(in-band error, /health 503), the server exits and leaves no process behind."""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil

from tests.server.harness import PACE_S, hooks_env, running_server, wait_until
from tests.server.test_lifecycle import STREAM, _consume, _gone

PROMPTS = [f"Count from {i} to {i + 5}:" for i in range(6)]


def _complete(url: str, prompt: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                    max_tokens=4, temperature=0, logprobs=0)
    return out.choices[0].logprobs.tokens


def test_dp2_spreads_requests_and_reports_a_killed_engine() -> None:
    with running_server("--max-num-seqs", "4") as one:
        with ThreadPoolExecutor(6) as pool:
            ref = list(pool.map(lambda p: _complete(one.url, p), PROMPTS))
        one_blocks = one.metrics()["pagedllm:kv_cache_total_blocks"]
    # Paced: the stream that is running when an engine is killed lasts at least 10 s.
    with running_server("-dp", "2", "--max-num-seqs", "4",
                        env=hooks_env(step_pace_s=PACE_S)) as s:
        pids = [int(p) for p in re.search(
            r"data-parallel engines ready \(pids \[(\d+), (\d+)\]\)", s.log()).groups()]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: _complete(s.url, p), PROMPTS))
        assert got == ref
        m = s.metrics()
        per_engine = [m['pagedllm:engine_requests_assigned{engine="0"}'],
                      m['pagedllm:engine_requests_assigned{engine="1"}']]
        assert sum(per_engine) == len(PROMPTS) and min(per_engine) >= 2, per_engine
        # The unlabelled gauges are totals over the engines.
        assert m["pagedllm:kv_cache_total_blocks"] == 2 * one_blocks

        out: dict = {}
        started = threading.Event()
        t = threading.Thread(target=_consume,
                             args=(s, {**STREAM, "max_tokens": 200}, out, started))
        t.start()
        assert started.wait(120)
        victim = psutil.Process(pids[1])
        victim.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        t.join(30)
        health: list[int] = []
        wait_until(lambda: _health(s.url, health) == 503 or s.proc.poll() is not None,
                   timeout=15)
        rc = s.proc.wait(30)
        assert rc != 0 and time.monotonic() - t0 < 20
        assert "data-parallel engine 1" in s.log()
        # The stream that was running (on whichever engine) ended with an error.
        assert out["events"][-1] == "[DONE]" and "error" in out["events"][-2]
        assert all(_gone(p) for p in pids)


def _health(url: str, seen: list[int]) -> int:
    import httpx

    try:
        code = httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        code = 0
    seen.append(code)
    return code
