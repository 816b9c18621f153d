"""Authentication of the API-server <-> engine-core ZeroMQ channel.

Threat: with ``--engine-transport tcp`` any local user can connect to the two loopback
ports the API server binds (and, with ipc, anyone who can reach the socket files).  A
peer that could connect would be able to inject frames (fake outputs, garbage) or join
the PUSH socket's round-robin as a PULL and steal requests.

Defence: ZeroMQ CURVE (CurveZMQ: X25519 key exchange, every frame encrypted and
authenticated) with keys made at start-up, plus ZAP, so that only the engine core's
public key is accepted:

* the API server (``AsyncMPClient``) makes two key pairs per launch: its own (the CURVE
  *server* side of both bound sockets) and the core's; the core's half travels to the
  spawned process through multiprocessing's private pipe, never over a socket or the
  command line;
* a ZAP handler (pyzmq's ``AsyncioAuthenticator``) in the API process admits a CURVE
  client only if its public key is the core's.  A peer without the keys fails the
  handshake inside libzmq: it never gets a pipe, so it can neither send a frame that
  reaches Python nor receive one (PUSH distributes only to handshaken peers);
* ``PeerMonitor`` watches both bound sockets and counts failed handshakes
  (``reason="handshake"``) -- random bytes, a NULL-mechanism peer, a wrong key -- with a
  log line, so an operator sees the attempts on ``/metrics``.

Frames from the authenticated core are still checked (``mp_client``): a malformed one is
dropped with a log line and counted (``reason="malformed"``), never fatal.

pyzmq wheels bundle libzmq with CURVE; a libzmq built without it (``zmq.has("curve")``
false) falls back to the unauthenticated channel with a warning, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.base import Authenticator
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "pagedllm-engine"

_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def curve_available() -> bool:
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class CoreKeys:
    """What the engine core needs to connect: the server's public key and its own pair
    (z85-encoded).  Picklable: it is a spawn argument."""

    server_public: bytes
    core_public: bytes
    core_secret: bytes

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a connecting socket of the core) a CURVE client."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.core_public
        sock.curve_secretkey = self.core_secret


@dataclass(frozen=True)
class TransportKeys:
    """One launch's keys, made by the API server (see the module doc)."""

    server_public: bytes
    server_secret: bytes
    core: CoreKeys

    @classmethod
    def generate(cls) -> TransportKeys:
        server_public, server_secret = zmq.curve_keypair()
        core_public, core_secret = zmq.curve_keypair()
        return cls(server_public, server_secret,
                   CoreKeys(server_public, core_public, core_secret))

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a bound socket of the API server) a CURVE server whose clients
        are checked by the ZAP handler (domain ``ZAP_DOMAIN``).  Call before ``bind``."""
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()


class _OnlyTheCore:
    """ZAP credentials provider: admits exactly one CURVE public key (a refusal shows up
    as a failed handshake, counted by ``PeerMonitor``)."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.allowed)


def start_authenticator(ctx: zmq.asyncio.Context, keys: TransportKeys) -> Authenticator:
    """Start the ZAP handler on the running event loop; returns it (``stop()`` it at
    shutdown).  Must run before the first peer connects."""
    auth = AsyncioAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _OnlyTheCore(keys.core.core_public))
    return auth


class PeerMonitor:
    """Counts failed handshakes on the bound sockets (``on_rejected("handshake")``) and
    logs each; runs as one task on the event loop until ``stop()``."""

    def __init__(self, sockets: dict[str, zmq.asyncio.Socket],
                 on_rejected: Callable[[str], None]) -> None:
        self.on_rejected = on_rejected
        self._monitors = {name: s.get_monitor_socket(_FAILED_EVENTS)
                          for name, s in sockets.items()}
        self._sockets = sockets
        self._tasks = [asyncio.get_running_loop().create_task(self._watch(name, m))
                       for name, m in self._monitors.items()]

    async def _watch(self, name: str, mon: zmq.asyncio.Socket) -> None:
        while True:
            frames = await mon.recv_multipart()
            try:
                event = parse_monitor_message(frames)
            except Exception:  # a monitor frame we do not understand: nothing to count
                continue
            logger.warning("engine transport: rejected a peer on the %s socket "
                           "(handshake failed, event 0x%x)", name, event["event"])
            self.on_rejected("handshake")

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for name, mon in self._monitors.items():
            with contextlib.suppress(zmq.ZMQError):
                self._sockets[name].disable_monitor()
            mon.close(linger=0)
