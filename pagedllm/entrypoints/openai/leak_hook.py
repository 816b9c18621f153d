"""Test-only fault injection: a deliberate memory leak, to prove the soak's detector.

``PAGEDLLM_TEST_LEAK_BYTES_PER_REQUEST=N`` (N > 0) makes the API server keep N bytes,
touched, for every ``/v1/`` request it receives, forever (up to ``LEAK_CAP`` bytes in
all, so a fast machine cannot be driven out of memory by the test).  Unset (always, outside that
test) the app is returned unchanged: nothing is added to the request path.
"""

from __future__ import annotations

import logging
import os

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

LEAK_ENV = "PAGEDLLM_TEST_LEAK_BYTES_PER_REQUEST"
LEAK_CAP = 1 << 30


def wrap(app: ASGIApp) -> ASGIApp:
    """``app`` itself, or (with ``LEAK_ENV`` set) ``app`` behind a leaking middleware."""
    n = int(os.environ.get(LEAK_ENV) or 0)
    if n <= 0:
        return app
    logger.warning("%s=%d: leaking %d bytes per request (test hook)", LEAK_ENV, n, n)
    leaked: list[bytes] = []

    async def leaking(scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"].startswith("/v1/")
                and len(leaked) * n < LEAK_CAP):
            leaked.append(b"x" * n)  # written, so the pages are resident
        await app(scope, receive, send)

    return leaking
