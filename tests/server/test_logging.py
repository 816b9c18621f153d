"""What ``pagedllm serve`` prints: one timestamp format across both processes and
uvicorn, an access line per request, and a start-up failure reported once."""

from __future__ import annotations

import re

import httpx

from tests.server.harness import ServerProcess, wait_until

LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")


def test_access_log_and_one_timestamp_format(server: ServerProcess) -> None:
    httpx.get(server.url + "/v1/models?probe=access-log")
    assert wait_until(lambda: '"GET /v1/models?probe=access-log HTTP/1.1" 200' in
                      server.log(), timeout=10)
    logged = [ln for ln in server.log().splitlines()
              if re.match(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b", ln)]
    for ln in logged:
        assert LINE.match(ln), f"a log line in another format: {ln!r}"
    assert any("[EngineCore pid=" in ln for ln in logged)
    assert any("pagedllm.api_server]" in ln for ln in logged)
    # Requests themselves are logged only with --enable-log-requests (test_hardening).
    assert "Received request" not in server.log()


def test_startup_failure_is_reported_once(default_model_path: str) -> None:
    # vLLM's positional form, `serve MODEL`, on a real server start.
    s = ServerProcess(default_model_path, "--kv-cache-memory-bytes", "1000")
    try:
        assert s.proc.wait(timeout=300) == 1
        log = s.log()
    finally:
        s.close()
    assert log.count("kv_cache_memory_bytes: 1000 bytes") == 1, log
    assert "--kv-cache-memory-bytes to at least" in log and "max_model_len to 0" not in log
    assert "Traceback" not in log
