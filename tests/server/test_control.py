"""Overload and cancellation: disconnects abort (blocks back to the pool, visible in
/metrics), cancel by id, many client time-outs, admission control (503 + Retry-After)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.harness import (
    PACE_S,
    ServerProcess,
    hooks_env,
    kv_idle,
    running_server,
    wait_until,
)

# On ``paced_server`` (conftest.py) a LONG request lasts at least 200 * PACE_S = 10 s:
# every disconnect, cancel and time-out below happens while it is still generating.
LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
        "temperature": 0}
ABORTS = 'vllm:request_success_total{finished_reason="abort"}'


def _data_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def test_stream_disconnect_aborts_and_frees_blocks(paced_server: ServerProcess) -> None:
    server = paced_server
    before = server.metrics().get(ABORTS, 0)
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = _data_events(r.iter_lines())
            first = next(events)
            assert isinstance(first, dict) and first["choices"][0]["text"] is not None
            m = server.metrics()
            assert m["vllm:num_requests_running"] >= 1
            assert m["vllm:kv_cache_usage_perc"] > 0
        # Leaving the block closes the connection mid-stream.
    assert wait_until(lambda: kv_idle(server) and server.metrics()[ABORTS] == before + 1,
                      timeout=30), server.metrics()


def test_non_streaming_disconnect_aborts(paced_server: ServerProcess) -> None:
    """A client that gives up on a non-streaming request (read time-out at 1.5 s, long
    before the paced request's 10 s) aborts it in the engine and frees its blocks."""
    server = paced_server
    before = server.metrics().get(ABORTS, 0)
    assert LONG["max_tokens"] * PACE_S > 4 * 1.5
    with server.client(timeout=1.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=LONG)
    assert wait_until(lambda: kv_idle(server) and server.metrics()[ABORTS] == before + 1,
                      timeout=30), server.metrics()


def test_chat_stream_disconnect_aborts(paced_server: ServerProcess) -> None:
    server = paced_server
    body = {"messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _data_events(r.iter_lines())
        next(events)  # role
        next(events)  # first content
    assert wait_until(lambda: kv_idle(server), timeout=30), server.metrics()


def test_cancel_by_id_streaming(paced_server: ServerProcess) -> None:
    server = paced_server
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                      headers={"X-Request-Id": "cancel-me"}) as r:
            events = _data_events(r.iter_lines())
            first = next(events)
            assert isinstance(first, dict) and first["id"] == "cmpl-cancel-me"
            with server.client() as c2:
                resp = c2.post("/v1/requests/cmpl-cancel-me/cancel")
                assert resp.status_code == 200 and resp.json()["cancelled"] is True
            rest = list(events)
        assert rest[-1] == "[DONE]"
        finals = [e["choices"][0]["finish_reason"] for e in rest[:-1]
                  if isinstance(e, dict) and e["choices"]]
        assert finals[-1] == "abort"
        # The id is free again once finished; cancelling it now is a 404.
        assert c.post("/v1/requests/cmpl-cancel-me/cancel").status_code == 404
    assert wait_until(lambda: kv_idle(server), timeout=30)


def test_cancel_by_id_non_streaming(paced_server: ServerProcess) -> None:
    server = paced_server
    result: dict[str, Any] = {}

    def run() -> None:
        with server.client() as c:
            result["r"] = c.post("/v1/chat/completions", headers={"X-Request-Id": "nb"},
                                 json={"messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 200, "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    with server.client() as c:
        assert wait_until(lambda: c.post("/v1/requests/chatcmpl-nb/cancel").status_code
                          == 200, timeout=60)
    t.join(60)
    r = result["r"]
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 200
    assert wait_until(lambda: kv_idle(server), timeout=30)


def test_many_client_timeouts_then_new_request(server: ServerProcess) -> None:
    """vLLM's test, scaled to a 2-core CPU: 64 long requests whose clients give up after
    0.5 s; then a new request succeeds promptly and every block is free again."""

    async def impatient(client: httpx.AsyncClient, i: int) -> None:
        body = {**LONG, "prompt": f"Request {i}: once upon a time"}
        try:
            await client.post("/v1/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass

    async def main() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
            await asyncio.gather(*(impatient(client, i) for i in range(64)))

    asyncio.run(main())
    t0 = time.monotonic()
    with server.client(timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
    assert time.monotonic() - t0 < 30
    assert wait_until(lambda: kv_idle(server), timeout=30), server.metrics()


# ----------------------------------------------------------------------------- admission


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    """One running slot and one queued slot, paced: a 16-token request holds its slot for
    at least 16 * PACE_S = 0.8 s, so the burst below always finds both slots taken."""
    with running_server("--max-num-queued-requests", "1", env=hooks_env(step_pace_s=PACE_S),
                        base_args=["--max-model-len", "256", "--max-num-seqs", "1"]) as s:
        yield s


async def _burst(url: str, n: int, body: dict[str, Any]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=n)) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body)
                                           for _ in range(n))))


def test_admission_control(small_server: ServerProcess) -> None:
    """SGLang's test: one running slot, one queued slot, ten concurrent requests ->
    exactly two 200s and eight 503s with Retry-After."""
    body = {"prompt": "Count to ten:", "max_tokens": 16, "ignore_eos": True}
    responses = asyncio.run(_burst(small_server.url, 10, body))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200] + [503] * 8, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"]
            assert r.json()["error"]["type"] == "service_unavailable_error"
    m = small_server.metrics()
    assert m['pagedllm:requests_rejected_total{reason="queue_full"}'] >= 8
    assert wait_until(lambda: kv_idle(small_server), timeout=30)
    # Capacity is back.
    with small_server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}
                      ).status_code == 200


def test_admission_all_or_nothing(small_server: ServerProcess) -> None:
    with small_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": 3})
        assert r.status_code == 503 and r.headers["retry-after"]
        r = c.post("/v1/completions", json={"prompt": ["Hi", "Yo", "Hey"], "max_tokens": 1})
        assert r.status_code == 503
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": 2}
                      ).status_code == 200
    assert wait_until(lambda: kv_idle(small_server), timeout=30)
