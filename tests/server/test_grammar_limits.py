"""Grammar work cannot stall the server (issue 46 items 5 and 6), against a real server.

Constraints over the up-front bounds (a schema nested 900 deep, a 50,000-value enum, a
5,000-rule EBNF, a deep ``text.format`` on ``/v1/responses``) are 400s naming the
limit; a check that runs past ``--structured-outputs-check-timeout`` is a 400 naming
that limit, its worker process is killed, and meanwhile ``/health`` and other requests
are answered.  The slow check is made deterministic by stopping the check worker
(SIGSTOP): no test here depends on how fast the machine compiles or generates."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.harness import ServerProcess, running_server, wait_until
from tests.structured_output.test_grammar_limits import big_ebnf, nested_arrays

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TIMEOUT_S = 3


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with running_server("--structured-outputs-check-timeout", str(TIMEOUT_S)) as s:
        yield s


def _alive(s: ServerProcess) -> None:
    with s.client(timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("path, extra, param, limit", [
    # 900 deep: the body's own nesting bound answers first (issue 46 item 9).
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested_arrays(900)}}}, "response_format", "levels"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested_arrays(100)}}}, "response_format", "64 levels"),
    ("/v1/chat/completions", {"guided_json": {"type": "string", "enum": [
        f"value-{i}" for i in range(50_000)]}}, "guided_json", "10000"),
    ("/v1/completions", {"structured_outputs": {"grammar": big_ebnf(5_000)}},
     "structured_outputs", "1000"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "deep",
                                           "schema": nested_arrays(100)}}},
     "response_format", "64 levels"),
])
def test_over_a_limit_is_400_naming_it(srv: ServerProcess, path: str, extra: dict,
                                       param: str, limit: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2, **extra} if path == "/v1/completions" else (
        {"input": "hi", "max_output_tokens": 16, **extra} if path == "/v1/responses"
        else {**CHAT, **extra})
    with srv.client(timeout=60) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert limit in err["message"] and ("limit" in err["message"]
                                        or "deeper than" in err["message"]), err
    if path != "/v1/responses":
        assert err["param"] == param, err
    _alive(srv)


def _check_workers(s: ServerProcess) -> list[int]:
    return [p.pid for p in s.descendants()
            if "pagedllm.structured_output.check_worker" in " ".join(p.cmdline())]


def test_a_check_over_its_time_budget_is_400_and_the_server_keeps_answering(
        srv: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ok = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}}}
    with srv.client(timeout=60) as c:
        assert c.post("/v1/chat/completions", json=ok).status_code == 200
    [pid] = _check_workers(srv)  # the one idle worker takes the next check
    os.kill(pid, signal.SIGSTOP)
    # (Another schema: one that passed is remembered, not checked again.)
    other = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {**schema, "required": ["a"]}}}}
    with ThreadPoolExecutor(1) as pool:
        with srv.client(timeout=60) as c:
            slow = pool.submit(c.post, "/v1/chat/completions", json=other)
            _alive(srv)  # answered while the check hangs on its stopped worker
            r = slow.result()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and f"limit of {TIMEOUT_S} s" in err["message"]
    assert wait_until(lambda: pid not in _check_workers(srv), timeout=10)
    with srv.client(timeout=60) as c:  # a fresh worker checks the next one
        assert c.post("/v1/chat/completions", json=other).status_code == 200
        assert c.post("/v1/chat/completions", json=ok).status_code == 200
    _alive(srv)
