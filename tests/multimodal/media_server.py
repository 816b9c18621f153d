"""A real HTTP server on 127.0.0.1 for image-fetch tests (``http.server`` in a thread).

Paths: ``/img.png`` (the image given), ``/sleep`` (sleeps ``SLEEP_S`` before answering),
``/big`` (streams ``BIG_BYTES`` without a Content-Length), ``/big-declared`` (declares a
huge Content-Length), ``/redirect/N`` (N redirects, then the image), ``/404``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLEEP_S = 30.0
BIG_BYTES = 64 * 1024 * 1024


def _handler(image: bytes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet test output
            pass

        def _send(self, status: int, body: bytes, ctype: str = "image/png") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path
            try:
                if path == "/img.png":
                    self._send(200, image)
                elif path == "/sleep":
                    time.sleep(SLEEP_S)
                    self._send(200, image)
                elif path == "/big":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    chunk = b"\0" * (1 << 16)
                    for _ in range(BIG_BYTES // len(chunk)):
                        self.wfile.write(chunk)
                elif path == "/big-declared":
                    self.send_response(200)
                    self.send_header("Content-Length", str(BIG_BYTES))
                    self.end_headers()
                    self.wfile.write(b"\0" * 1024)
                elif path.startswith("/redirect/"):
                    n = int(path.rsplit("/", 1)[1])
                    self.send_response(302)
                    self.send_header("Location", f"/redirect/{n - 1}" if n > 1 else
                                     "/img.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._send(404, b"not found", "text/plain")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the point of /sleep and /big)

    return Handler


@contextlib.contextmanager
def media_server(image: bytes) -> Iterator[str]:
    """Serve ``image`` (and the paths above); yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(image))
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
