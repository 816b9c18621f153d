"""``pagedllm bench soak``: a short real soak passes, and its detectors catch a
deliberate memory leak (the API server's test-only leak hook) and KV blocks still in use
after the drain (a long request the test keeps running)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading

import httpx

from tests.server.harness import PACE_S, hooks_env, running_server

SOAK = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "soak"]


def _soak(*args: str) -> tuple[int, dict, str]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        p = subprocess.run([*SOAK, *args, "--output", out.name], capture_output=True,
                           text=True, timeout=600)
        with open(out.name, encoding="utf-8") as f:
            written = f.read()
    text = p.stdout + p.stderr
    # 0 and 1 are the soak's verdicts, each with its summary; anything else is a crash.
    assert p.returncode in (0, 1) and written, f"soak exited {p.returncode}:\n{text}"
    return p.returncode, json.loads(written), text


def test_short_soak_passes() -> None:
    """The CI soak: the command starts its own server and every check holds (25 s at
    concurrency 4: ~200 requests of every kind on a 2-core CPU; RSS watched for the
    15 s after the warm-up)."""
    rc, summary, text = _soak("--duration", "25", "--seed", "0", "--concurrency", "4",
                              "--warmup", "10")
    assert rc == 0, text
    assert summary["passed"] and not summary["failures"], text
    assert summary["server_exit_status"] == 0
    assert {"valid", "invalid"} <= set(summary["by_kind"]), text
    assert summary["requests"] >= 5
    assert set(summary["rss"]) >= {"api_server", "engine_core"}, summary["rss"]
    kv = summary["kv_after_drain"]
    assert kv["kv_cache_usage_perc"] == 0 and kv["num_requests_running"] == 0
    assert "PASSED" in text


def test_soak_catches_a_memory_leak_and_blocks_in_use() -> None:
    """The API server leaks 40 MiB a second from the held request on (at most 2 GiB, 51 s):
    from the end of the soak's 3 s warm-up to after its 12 s of traffic it grows by about
    9 * 40 MiB, far over the 100 MB bound, whether a loaded machine serves few requests
    or a quiet one many (a per-request leak depended on that count).
    Paced, the held 4,000-token request lasts at least 4000 * PACE_S = 200 s: it is still
    running (its blocks in use) when the soak drains, on any machine."""
    with running_server(env=hooks_env(step_pace_s=PACE_S, leak_bytes_per_s=40 << 20),
                        base_args=["--max-model-len", "4096", "--max-num-seqs", "8"]) as s:
        held = threading.Event()
        release = threading.Event()

        def hold_a_long_request() -> None:
            body = {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(base_url=s.url, timeout=600) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # kept open: closing it would disconnect
                while not next(lines).startswith("data: "):
                    pass
                held.set()
                release.wait(600)  # leaving the block disconnects: the server aborts it

        t = threading.Thread(target=hold_a_long_request)
        t.start()
        try:
            assert held.wait(120)
            rc, summary, text = _soak("--base-url", s.url, "--pid", str(s.pid),
                                      "--duration", "12", "--warmup", "3",
                                      "--concurrency", "2", "--drain-timeout", "3")
        finally:
            release.set()
            t.join(60)
    assert rc == 1, text
    assert not summary["passed"] and not summary["failures"], text
    reasons = " ".join(summary["reasons"])
    assert "RSS grew" in reasons and summary["rss_growth_mb"] > 100, text
    assert "not idle" in reasons and summary["kv_after_drain"]["kv_cache_usage_perc"] > 0
    assert "FAILED" in text
