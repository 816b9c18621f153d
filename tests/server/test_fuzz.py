"""Fuzz every operation of ``/openapi.json`` with schemathesis (valid and invalid bodies,
headers, paths): the server never answers 5xx and stays healthy.

The fuzzed server has a 16-token context, so whatever ``max_tokens`` the fuzzer picks a
generation stays cheap on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.harness import ServerProcess, running_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    with running_server(base_args=["--max-model-len", "16", "--max-num-seqs", "4"]) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess):  # type: ignore[no-untyped-def]
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx(case, fuzz_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.path, case.body, response.text[:300])
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith(
            "application/json"):
        err = response.json().get("error")
        assert err and set(err) == {"message", "type", "param", "code"}, response.text


def test_alive_after_fuzz(fuzz_server: ServerProcess) -> None:
    with fuzz_server.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
    assert httpx.get(fuzz_server.url + "/openapi.json").status_code == 200
