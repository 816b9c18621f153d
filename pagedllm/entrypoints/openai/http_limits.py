"""Connection-level limits of the HTTP server: request heads, header-read time, open
connections, file descriptors (uvicorn's h11 protocol, subclassed).

What uvicorn alone leaves open (issue 28):

* A connection that never finishes its request head holds a file descriptor forever
  (uvicorn's keep-alive timer starts only after a response, and any byte resets it), so
  ~1,000 slow clients exhaust the descriptors and ``/health`` times out (slowloris).
* An oversized head is answered 400 by h11 only once its buffer limit is hit; header
  *count* is not bounded at all.

``limited_h11_protocol(limits)`` returns an ``H11Protocol`` subclass that adds:

* **head bounds**: more than ``max_header_bytes`` bytes or ``max_header_count`` header
  lines before the blank line ending the head -> ``431`` at once (the rest is never
  parsed), then a lingering close (the answer is not lost to a TCP reset);
* **header-read timeout**: a head not complete ``header_timeout`` seconds after it
  started (or after the connection opened) -> ``408`` and close;
* **body-read timeout**: a request body not complete ``body_timeout`` seconds after its
  head (a client that sends a head, then trickles or withholds the body) -> ``408`` and
  close, unless the response has started; a body that keeps coming at a rate below
  :data:`MIN_BODY_RATE` is cut at that deadline, but a big body arriving at a normal
  rate gets more time (the deadline grows with ``Content-Length`` at that rate);
* **connection cap**: at most ``max_connections`` open connections.  A new one beyond
  it evicts the oldest connection that is *not* serving a request (idle keep-alive or
  still sending its head); if every connection is busy, the new one gets ``503`` with
  ``Retry-After``.  So slow clients can never lock out a real one, and descriptors stay
  bounded.

``raise_fd_limit`` lifts the soft ``RLIMIT_NOFILE`` to the hard limit at start-up (as
vLLM does) and ``default_max_connections`` keeps a reserve below it for the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("pagedllm.api_server")

# Descriptors kept back from the connection cap: model files, engine sockets, logs.
FD_RESERVE = 256
LINGER_S = 1.0
# Bytes per second a body may arrive at and still get more time than ``body_timeout``.
MIN_BODY_RATE = 64 * 1024


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 65536)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(fd_limit: int) -> int:
    """The connection cap for ``fd_limit`` descriptors (at least 16)."""
    return max(16, fd_limit - FD_RESERVE)


@dataclass
class HTTPLimits:
    """The knobs (serve flags of the same names) and the registry of open connections."""

    max_header_bytes: int = 16 * 1024
    max_header_count: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    # Open connections, oldest first (dicts keep insertion order).
    open: dict[Any, None] = field(default_factory=dict, repr=False)


def _raw_response(status: int, reason: str, message: str,
                  extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "service_unavailable_error",
                                 "param": None, "code": None}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def limited_h11_protocol(limits: HTTPLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` enforced (see the module doc)."""

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._head_lines = 0
            self._tail = b""
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._discarding = False

        # -------------------------------------------------------------- life cycle

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            limits.open[self] = None
            if len(limits.open) > limits.max_connections and not self._evict_one():
                logger.warning("connection limit (%d) reached with every connection "
                               "busy: refusing a new one", limits.max_connections)
                self._reject(503, "Service Unavailable",
                             "the server has too many open connections; retry later",
                             (("retry-after", "1"),))
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            limits.open.pop(self, None)
            self._cancel_header_timer()
            self._cancel_body_timer()
            super().connection_lost(exc)

        def _busy(self) -> bool:
            """Serving a request (head received, response not finished)."""
            return self.cycle is not None and not self.cycle.response_complete \
                and self.conn.their_state is not h11.IDLE

        def _evict_one(self) -> bool:
            for conn in limits.open:
                if conn is not self and not conn._busy():
                    limits.open.pop(conn, None)
                    conn.transport.close()
                    return True
            return False

        # -------------------------------------------------------------- head bounds

        def _arm_header_timer(self) -> None:
            if self._header_timer is None and not self._discarding:
                self._header_timer = self.loop.call_later(limits.header_timeout,
                                                          self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._head_bytes:
                    self._reject(408, "Request Timeout",
                                 f"request head not received within "
                                 f"{limits.header_timeout} s")
                else:
                    self.transport.close()

        # -------------------------------------------------------------- body bound

        def _arm_body_timer(self) -> None:
            """Called when a head is complete and a body is expected."""
            if self._body_timer is not None:
                return
            length = 0
            for name, value in self.cycle.scope["headers"] if self.cycle else ():
                if name == b"content-length" and value.isdigit():
                    length = int(value)
            timeout = max(limits.body_timeout, length / MIN_BODY_RATE)
            self._body_timer = self.loop.call_later(timeout, self._on_body_timeout,
                                                    timeout)

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _on_body_timeout(self, timeout: float) -> None:
            self._body_timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            if self.cycle is not None and self.cycle.response_started:
                self.transport.close()  # nothing sensible to add to a started answer
                return
            logger.warning("request body not received within %.0f s: 408", timeout)
            if self.cycle is not None:  # the app, waiting for the body, sees a disconnect
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self._reject(408, "Request Timeout",
                         f"request body not received within {timeout:.0f} s "
                         "(--body-read-timeout)")

        def _reject(self, status: int, reason: str, message: str,
                    extra: tuple[tuple[str, str], ...] = ()) -> None:
            """Answer without h11 and close, reading (and dropping) what the client
            still sends for a moment, so the answer is not lost to a TCP reset."""
            self._cancel_header_timer()
            self._cancel_body_timer()
            self._discarding = True
            limits.open.pop(self, None)
            self.transport.write(_raw_response(status, reason, message, extra))
            try:
                self.transport.write_eof()
            except (OSError, RuntimeError, NotImplementedError):
                pass
            self.loop.call_later(LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return
            if self.conn.their_state is h11.IDLE:
                self._arm_header_timer()
                buf = self._tail + data
                end = buf.find(b"\r\n\r\n")
                head = data if end < 0 else data[:max(0, end + 4 - len(self._tail))]
                self._head_bytes += len(head)
                self._head_lines += head.count(b"\n")
                self._tail = buf[-3:]
                # Lines: the request line and the blank line are not headers.
                if (self._head_bytes > limits.max_header_bytes
                        or self._head_lines > limits.max_header_count + 2):
                    logger.warning("request head over its limits (%d bytes, %d lines): "
                                   "431", self._head_bytes, self._head_lines)
                    self._reject(431, "Request Header Fields Too Large",
                                 f"request headers exceed {limits.max_header_bytes} "
                                 f"bytes or {limits.max_header_count} fields")
                    return
                if end >= 0:
                    self._head_bytes = self._head_lines = 0
                    self._tail = b""
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()
            if self.conn.their_state is h11.SEND_BODY:
                self._arm_body_timer()
            else:
                self._cancel_body_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_bytes = self._head_lines = 0
            self._tail = b""

    return LimitedH11Protocol
