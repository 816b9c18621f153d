"""The chat page at ``/`` (``pagedllm serve --no-ui`` turns it off).

Four static files shipped in the package (``static/``; no build step, nothing fetched
from elsewhere): the page calls this server's own OpenAI API from the browser.  They are
a shell without data, so they are public even with ``--api-key``; everything the page
does goes through the API, which needs the key (the page asks for it).  Served by exact
paths only (``UI_PATHS``, which the API-key middleware lets through), with a
Content-Security-Policy that allows this origin alone, so the page cannot load or send
anything elsewhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
    # The page names its icon (a browser would otherwise ask for /favicon.ico: a 404).
    "/ui/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
UI_PATHS = frozenset(_FILES)
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _endpoint(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:  # no parameters: nothing from the request is read
        return Response(body, media_type=media_type, headers=_HEADERS)

    return serve


def add_chat_ui(app: FastAPI) -> None:
    """Route ``UI_PATHS`` on ``app``; the files are read once, here."""
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _endpoint((STATIC / name).read_bytes(), media_type),
                          methods=["GET"], include_in_schema=False)
