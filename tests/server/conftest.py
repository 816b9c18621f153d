"""Fixtures of the server tests (helpers live in ``harness.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.server.harness import PACE_S, ServerProcess, hooks_env, running_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared default server (default model, small context), for the whole session."""
    with running_server() as s:
        yield s


@pytest.fixture(scope="session")
def paced_server() -> Iterator[ServerProcess]:
    """The default server with every engine step paced to ``PACE_S`` seconds: a request
    of N tokens lasts at least ``N * PACE_S`` s, so a test that disconnects, cancels or
    stops it mid-generation acts while it is still running, on any machine."""
    with running_server(env=hooks_env(step_pace_s=PACE_S)) as s:
        t0 = time.monotonic()
        with s.client() as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8,
                                                "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - t0 >= 8 * PACE_S, "the pacing hook is not installed"
        yield s
