"""Issue 28 (HTTP half): hostile requests, heads and connections never take the server
down.  Each case was a 5xx, a dead engine, a stall or a crash before its fix; now each is
a 4xx naming the field (or a bounded refusal) and the engine stays alive.

One server for the module (admission limit 2, request templates allowed, small
connection limits) keeps start-ups to one.
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.server.harness import ServerProcess, running_server, wait_until

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
OK = {"prompt": "Hi", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
MAX_CONNECTIONS = 32
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def hard() -> Iterator[ServerProcess]:
    with running_server(
            "--trust-request-chat-template", "--max-num-queued-requests", "0",
            "--max-connections", str(MAX_CONNECTIONS),
            "--header-read-timeout", str(HEADER_TIMEOUT),
            "--body-read-timeout", str(BODY_TIMEOUT),
            "--enable-log-requests", "--max-log-len", "5",
            base_args=["--max-model-len", "256", "--max-num-seqs", "2"]) as s:
        yield s


def _post(s: ServerProcess, path: str, body: dict[str, Any],
          timeout: float = 120) -> httpx.Response:
    # json.dumps (ensure_ascii) writes a lone surrogate as the escape "\ud800", which is
    # what a hostile client sends; httpx's own encoder cannot encode one at all.
    return httpx.post(s.url + path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=timeout)


def _alive(s: ServerProcess) -> None:
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200


# ----------------------------------------------------------------------------- bad input

BAD: list[tuple[str, dict[str, Any], str]] = [
    # seed: int64 as in vLLM; 2^64-1 with n=2 used to overflow the child seed and kill
    # the engine core.
    ("/v1/completions", {**OK, "seed": 2**64 - 1, "n": 2}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64 - 1, "n": 2}, "seed"),
    ("/v1/completions", {**OK, "seed": 2**64}, "seed"),
    ("/v1/completions", {**OK, "seed": INT64_MIN - 1}, "seed"),
    ("/v1/completions", {**OK, "seed": 1e100}, "seed"),
    ("/v1/completions", {**OK, "top_k": 10**24}, "top_k"),
    ("/v1/completions", {**OK, "top_k": 1e24}, "top_k"),
    ("/v1/completions", {**OK, "priority": 10**30}, "priority"),
    ("/v1/completions", {**OK, "priority": 1e30}, "priority"),
    ("/v1/completions", {**OK, "priority": INT64_MIN - 1}, "priority"),
    ("/v1/completions", {**OK, "max_tokens": 10**30}, "max_tokens"),
    # Lone UTF-16 surrogates.
    ("/v1/completions", {**OK, "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {**OK, "prompt": ["ok", "\udfff"]}, "prompt.1"),
    ("/v1/completions", {**OK, "model": "\ud800"}, "model"),
    ("/v1/completions", {**OK, "stop": ["\ud800"]}, "stop.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x\udc00"}]},
     "messages.0.content"),
    ("/tokenize", {"prompt": "hi", "model": "\ud800"}, "model"),
    # Template kwargs colliding with the renderer's own arguments.
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"conversation": 1}},
     "chat_template_kwargs"),
    # min_tokens above the context (max_tokens omitted): no forced full-context run.
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 1000}, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 10**30}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT["messages"], "min_tokens": 300}, "min_tokens"),
    # Strict types: no "yes" for true, no 1 for a boolean, no "3" for an integer.
    ("/v1/completions", {**OK, "stream": "yes"}, "stream"),
    ("/v1/completions", {**OK, "stream": 1}, "stream"),
    ("/v1/completions", {**OK, "echo": "true"}, "echo"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options":
                              {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("/v1/completions", {**OK, "n": "2"}, "n"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
    # More prompts than --max-inputs-per-request (2048), refused before tokenising
    # (issue 46 item 7).
    ("/v1/completions", {**OK, "prompt": ["Hi"] * 2049}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in
                                                       enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(hard: ServerProcess, path: str,
                                           body: dict[str, Any], param: str) -> None:
    r = _post(hard, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"] and "Traceback" not in err["message"]
    _alive(hard)


def test_extreme_valid_seeds_keep_the_engine_alive(hard: ServerProcess) -> None:
    """The int64 ends are valid seeds; their n=2 children wrap instead of overflowing,
    and each sample stays reproducible."""
    for seed in (INT64_MAX, INT64_MIN):
        body = {**OK, "max_tokens": 2, "seed": seed, "n": 2, "temperature": 1.0}
        first = _post(hard, "/v1/completions", body)
        assert first.status_code == 200, first.text
        again = _post(hard, "/v1/completions", body)
        assert [c["text"] for c in again.json()["choices"]] == \
            [c["text"] for c in first.json()["choices"]]
    _alive(hard)
    assert _post(hard, "/v1/completions", {**OK, "top_k": INT64_MAX}).status_code == 200


# ----------------------------------------------------------------------------- admission


def test_multi_prompt_admission_all_or_nothing(hard: ServerProcess) -> None:
    """Limit 2 in flight: 3 prompts (or 2 prompts x n=2) are refused whole; concurrent
    2-prompt requests are each admitted whole or refused whole."""
    for body in ({"prompt": ["a", "b", "c"], "max_tokens": 1},
                 {"prompt": [[1, 2], [3], [4]], "max_tokens": 1},
                 {"prompt": ["a", "b"], "max_tokens": 1, "n": 2}):
        r = _post(hard, "/v1/completions", body)
        assert r.status_code == 503 and r.headers["retry-after"], r.text

    async def burst() -> list[httpx.Response]:
        body = {"prompt": ["Count to ten:", "Say hi"], "max_tokens": 4, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=hard.url, timeout=120) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=body)
                                               for _ in range(4))))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 200 in codes, codes
    for r in responses:
        if r.status_code == 200:
            assert len(r.json()["choices"]) == 2
            assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    m = hard.metrics()
    assert m.get("vllm:num_requests_running", 0) <= 2


# ----------------------------------------------------------------------------- big inputs


def test_big_prompt_does_not_stall_the_event_loop(hard: ServerProcess) -> None:
    """A multi-MB prompt tokenises for seconds, off the event loop: /health keeps
    answering meanwhile (it stalled for the whole tokenisation before)."""
    text = "hello world, this is a long prompt. " * 60_000  # ~2.2 MB
    out: dict[str, Any] = {}

    def big() -> None:
        out["r"] = _post(hard, "/v1/completions", {"prompt": text, "max_tokens": 1})

    t = threading.Thread(target=big)
    t.start()
    times: list[float] = []
    with hard.client(timeout=30) as c:
        time.sleep(0.3)  # the body is sent and tokenisation has begun
        while t.is_alive():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            times.append(time.monotonic() - t0)
            time.sleep(0.02)
    t.join()
    assert out["r"].status_code == 400
    assert out["r"].json()["error"]["code"] == "context_length_exceeded"
    assert len(times) >= 5, times
    # 100 ms is the bound; the max allows for the shared 2-core CI machine's
    # scheduling noise (before the fix a single /health waited for the whole tokenisation).
    assert statistics.median(times) < 0.1, times
    assert max(times) < 1.0, times


# ----------------------------------------------------------------------------- templates

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}" \
               "{% endfor %}"


def test_request_templates_render_in_a_bounded_sandbox(hard: ServerProcess) -> None:
    """An allowed request template renders like the tokenizer's; a burning one (nested
    loops, a 100 MB string, a memory bomb) is a 400 naming chat_template, the API
    process neither stalls nor grows, and the engine stays alive."""
    plain = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    r = _post(hard, "/v1/chat/completions", {**CHAT, "chat_template": plain,
                                             "add_special_tokens": False})
    assert r.status_code == 200, r.text
    want = _post(hard, "/tokenize", {"prompt": "<user>Hi", "add_special_tokens": False})
    assert r.json()["usage"]["prompt_tokens"] == want.json()["count"]

    api = psutil.Process(hard.pid)
    rss0 = api.memory_info().rss
    for template in (NESTED_LOOPS, "{{ 'a' * 100000000 }}", "{{ 'a' * 10**11 }}",
                     "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"):
        out: dict[str, Any] = {}

        def call(out: dict[str, Any] = out, template: str = template) -> None:
            out["r"] = _post(hard, "/v1/chat/completions",
                             {**CHAT, "chat_template": template})

        t = threading.Thread(target=call)
        t.start()
        health = []
        with hard.client(timeout=30) as c:
            while t.is_alive():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.05)
        t.join()
        r = out["r"]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template" and err["message"].startswith(
            "chat_template: "), err
        assert not health or statistics.median(health) < 0.1, health
    assert api.memory_info().rss - rss0 < 100 * 2**20
    # A bad template after all that still renders fine ones.
    assert _post(hard, "/v1/chat/completions", {**CHAT, "chat_template": plain}
                 ).status_code == 200
    _alive(hard)


# ----------------------------------------------------------------------------- heads


def _addr(s: ServerProcess) -> tuple[str, int]:
    u = urlparse(s.url)
    assert u.hostname and u.port
    return u.hostname, u.port


def _send_head_until_answer(s: ServerProcess, head: bytes, chunk: int = 4096
                            ) -> tuple[bytes, int]:
    """Send ``head`` in chunks, stopping as soon as the server answers; returns (the
    answer, bytes sent)."""
    sock = socket.create_connection(_addr(s), timeout=10)
    sent = 0
    try:
        while sent < len(head):
            try:
                sock.sendall(head[sent:sent + chunk])
            except OSError:
                break
            sent += chunk
            if select.select([sock], [], [], 0.01)[0]:
                break
        sock.settimeout(10)
        data = b""
        while not data.endswith(b"}"):
            try:
                part = sock.recv(65536)
            except OSError:
                break
            if not part:
                break
            data += part
        return data, sent
    finally:
        sock.close()


@pytest.mark.parametrize("kind", ["100KB", "5000headers", "300headers", "8MiB"])
def test_oversized_heads_get_431_early(hard: ServerProcess, kind: str) -> None:
    start = b"GET /health HTTP/1.1\r\nhost: x\r\n"
    extra = {"100KB": b"x-big: " + b"a" * 100_000 + b"\r\n",
             "5000headers": b"".join(b"x-%d: 1\r\n" % i for i in range(5000)),
             "300headers": b"".join(b"x-%d: 1\r\n" % i for i in range(300)),
             "8MiB": b"x-big: " + b"a" * (8 << 20) + b"\r\n"}[kind]
    answer, sent = _send_head_until_answer(hard, start + extra + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert sent <= 64 * 1024  # refused early, not after reading megabytes
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"]
    _alive(hard)


def test_slowloris_cannot_lock_out_health(hard: ServerProcess) -> None:
    """Many connections that never finish their head: descriptors stay bounded by
    --max-connections, a real client still gets /health at once (the oldest idle or
    unfinished connection is evicted for it), and unfinished heads are dropped after
    --header-read-timeout."""
    api = psutil.Process(hard.pid)
    fds0 = api.num_fds()
    slow = []
    try:
        for _ in range(4 * MAX_CONNECTIONS):
            sock = socket.create_connection(_addr(hard), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            slow.append(sock)
        time.sleep(0.5)
        assert api.num_fds() <= fds0 + MAX_CONNECTIONS + 8
        for _ in range(5):
            t0 = time.monotonic()
            assert httpx.get(hard.url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 1.0
        # The newest slow connections are still open; after the timeout they are gone.
        assert wait_until(lambda: api.num_fds() <= fds0 + 4, timeout=HEADER_TIMEOUT + 10)
        last = slow[-1]
        last.settimeout(5)
        answer = last.recv(4096)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    finally:
        for sock in slow:
            sock.close()
    _alive(hard)


def test_slow_bodies_get_408(hard: ServerProcess) -> None:
    """A client that sends its head, then trickles (or withholds) the body, is answered
    408 after --body-read-timeout and its connection closed; one that sends its body
    in pieces within the time is served."""
    body = json.dumps(OK).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % (len(body) + 1000))
    socks = [socket.create_connection(_addr(hard), timeout=15) for _ in range(2)]
    try:
        t0 = time.monotonic()
        for sock in socks:
            sock.sendall(head)
        socks[1].sendall(body[:5])
        trickled = 5
        answers = [b"", b""]
        socks[0].settimeout(BODY_TIMEOUT + 10)
        answers[0] = socks[0].recv(4096)  # withheld body
        while not answers[1]:  # a byte every 0.2 s: never complete
            socks[1].sendall(b" ")
            trickled += 1
            socks[1].settimeout(0.2)
            try:
                answers[1] = socks[1].recv(4096)
            except TimeoutError:
                pass
            assert time.monotonic() - t0 < BODY_TIMEOUT + 10
        for a in answers:
            assert a.startswith(b"HTTP/1.1 408 "), a[:200]
            assert b"--body-read-timeout" in a
        assert time.monotonic() - t0 >= BODY_TIMEOUT - 0.5
    finally:
        for sock in socks:
            sock.close()
    # A body sent in pieces, in time, is served as usual.
    with socket.create_connection(_addr(hard), timeout=60) as sock:
        sock.sendall(head.replace(b"%d" % (len(body) + 1000), b"%d" % len(body)))
        for i in range(0, len(body), 7):
            sock.sendall(body[i:i + 7])
            time.sleep(0.05)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    _alive(hard)


def test_enable_log_requests(hard: ServerProcess) -> None:
    """--enable-log-requests: one INFO line per request with its id, params, prompt
    length and ids, cut to --max-log-len (5 here)."""
    prompt = "one two three four five six seven eight"
    r = httpx.post(hard.url + "/v1/completions", json={**OK, "prompt": prompt},
                   headers={"x-request-id": "log-probe-1"}, timeout=120)
    assert r.status_code == 200
    assert wait_until(lambda: "Received request cmpl-log-probe-1" in hard.log(),
                      timeout=10)
    [line] = [ln for ln in hard.log().splitlines() if "cmpl-log-probe-1" in ln
              and "Received request" in ln]
    assert line.startswith("INFO ")
    assert "prompt: 'one t'" in line and "max_tokens=1" in line
    ids = re.search(r"prompt_token_ids: \[([0-9, ]+)\], prompt length: (\d+)", line)
    assert ids is not None, line
    assert len(ids.group(1).split(",")) == 5 and int(ids.group(2)) > 5


def test_engine_alive_after_everything(hard: ServerProcess) -> None:
    _alive(hard)
    r = _post(hard, "/v1/completions", {**OK, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
