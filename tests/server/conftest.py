"""Fixtures of the server tests (helpers live in ``harness.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.harness import ServerProcess, running_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared default server (default model, small context), for the whole session."""
    with running_server() as s:
        yield s
