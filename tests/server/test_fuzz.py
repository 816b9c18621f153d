"""Fuzz every operation of ``/openapi.json`` with schemathesis (valid and invalid bodies,
headers, paths): the server never answers 5xx and ``/health`` is 200 after every case.
The explicit hostile cases of issue 28 are in ``test_hardening.py``.

The fuzzed server has a 16-token context, so whatever ``max_tokens`` the fuzzer picks a
generation stays cheap on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.harness import ServerProcess, running_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    with running_server(base_args=["--max-model-len", "16", "--max-num-seqs", "4"]) as s:
        yield s


def _operations(url: str) -> list:  # type: ignore[type-arg]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


# schemathesis' pytest plugin does not support this pytest; drive its strategies with
# hypothesis directly: per operation, schema-valid and schema-violating cases.
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_5xx(fuzz_server: ServerProcess, mode: str) -> None:
    from schemathesis import GenerationMode

    ops = _operations(fuzz_server.url)
    assert any(op.path == "/v1/chat/completions" for op in ops)
    gen_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    checked: list[str] = []
    health = httpx.Client(base_url=fuzz_server.url, timeout=30)
    for op in ops:
        strategy = op.as_strategy(generation_mode=gen_mode)

        @given(case=strategy)
        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:  # type: ignore[no-untyped-def]
            response = case.call(base_url=fuzz_server.url, timeout=120)
            assert response.status_code < 500, (case.method, case.path, case.body,
                                                response.text[:300])
            ctype = response.headers.get("content-type") or ""
            if isinstance(ctype, list):  # schemathesis keeps every value of a header
                ctype = ctype[0] if ctype else ""
            if response.status_code >= 400 and ctype.startswith("application/json"):
                err = response.json().get("error")
                # The Anthropic Messages API answers in Anthropic's envelope
                # ({"type": "error", "error": {"type", "message", ...}}), others OpenAI's.
                want = {"message", "type"} if case.path.startswith("/v1/messages") \
                    else {"message", "type", "param", "code"}
                assert err and want <= set(err) and (
                    case.path.startswith("/v1/messages") or set(err) == want), response.text
            # Engine alive after every case, not only at the end.
            assert health.get("/health").status_code == 200, (case.method, case.path,
                                                              case.body)

        try:
            run()
        except Exception as e:
            # Some schema-violating parts cannot be generated for every operation.
            if type(e).__name__ in ("Unsatisfiable", "GenerationError") or \
                    "cannot be generated" in str(e).lower():
                continue
            raise
        checked.append(f"{op.method} {op.path}")
    health.close()
    assert len(checked) >= 4, checked


def test_alive_after_fuzz(fuzz_server: ServerProcess) -> None:
    with fuzz_server.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
    assert httpx.get(fuzz_server.url + "/openapi.json").status_code == 200
