"""Client side of the engine-core process (see ``core_proc`` for the wire protocol).

``AsyncMPClient`` starts ``run_engine_core`` in a *spawned* process (a fresh interpreter:
no forked CUDA/torch state, no inherited sockets), binds the two sockets in a private
temporary directory (``ipc://``) or on ``tcp://127.0.0.1`` and waits for the core's
``EngineCoreReady``.  Both sockets are CURVE servers whose ZAP handler admits only the
core's per-launch key (``transport_auth.py``); a malformed message from the core is
dropped, logged and counted in ``rejected`` (``on_rejected`` feeds ``/metrics``).

Death detection (RELIABILITY: "the API server notices within seconds"):

* the output reader polls with a short timeout and checks the process' exit code between
  polls, so a killed core is noticed within ``poll_interval`` seconds;
* ``EngineCoreOutputs.engine_error`` (a failed step) is turned into ``EngineDeadError``;
* ``heartbeat_age()`` is the time since the last message: ``/health`` compares it with a
  threshold, so a core that is alive but stuck turns the server unhealthy too.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.engine.core_proc import (
    KIND_ABORT,
    KIND_ADD,
    KIND_OUTPUTS,
    KIND_READY,
    KIND_SHUTDOWN,
    EngineCoreReady,
    run_engine_core,
)
from pagedllm.engine.socket_dirs import make_socket_dir
from pagedllm.engine.transport_auth import (
    Authenticator,
    PeerMonitor,
    TransportKeys,
    curve_available,
    start_authenticator,
)
from pagedllm.executor.process_start import start_process
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is gone (exited, killed, or failed a step).  The message is safe
    to show a client (no paths or tracebacks)."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message is a one-line reason."""


class AsyncMPClient:
    """Async client of an engine core running in its own process.

    ``config``: an ``EngineConfig``, or ``EngineArgs`` (the core builds the config).
    Use: ``client = AsyncMPClient(config); ready = await client.start()``; then
    ``add_requests`` / ``abort_requests`` and a single reader calling ``get_output``;
    finally ``shutdown()``.  Not thread-safe: one event loop owns it.
    """

    def __init__(self, config: Any, *, transport: str = "ipc",
                 heartbeat_interval: float = 0.5, poll_interval: float = 0.2,
                 authenticate: bool = True) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.config = config
        self.transport = transport
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.ctx = zmq.asyncio.Context(io_threads=1)
        self._tmpdir: str | None = None
        self.input = self.ctx.socket(zmq.PUSH)
        self.output = self.ctx.socket(zmq.PULL)
        for s in (self.input, self.output):
            s.setsockopt(zmq.LINGER, 0)
        # CURVE keys for this launch (transport_auth.py); None: unauthenticated channel.
        self.keys: TransportKeys | None = None
        if authenticate and curve_available():
            self.keys = TransportKeys.generate()
            for s in (self.input, self.output):
                self.keys.secure(s)
        elif authenticate:
            logger.warning("libzmq has no CURVE support: the engine transport is not "
                           "authenticated")
        self._auth: Authenticator | None = None
        self._monitor: PeerMonitor | None = None
        # Frames refused (failed handshakes, malformed frames) by reason; ``on_rejected``
        # (the server's Prometheus counter) is called for each.
        self.rejected: collections.Counter[str] = collections.Counter()
        self.on_rejected: Callable[[str], None] | None = None
        self.input_addr = self.output_addr = ""
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready_decoder = msgspec.msgpack.Decoder(EngineCoreReady)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.ready: EngineCoreReady | None = None
        self.last_message = time.monotonic()
        self.dead: EngineDeadError | None = None
        self._closed = False

    def _bind(self) -> None:
        """Start the ZAP handler and the peer monitor, then bind (no peer may connect
        before the handler runs)."""
        if self.keys is not None:
            self._auth = start_authenticator(self.ctx, self.keys)
        self._monitor = PeerMonitor({"input": self.input, "output": self.output},
                                    self._reject)
        if self.transport == "ipc":
            # A private 0700 directory: other local users cannot connect to the sockets.
            # Named after this process so a later start can remove it if we are
            # SIGKILLed (socket_dirs.py).
            self._tmpdir = make_socket_dir()
            self.input_addr = f"ipc://{self._tmpdir}/input"
            self.output_addr = f"ipc://{self._tmpdir}/output"
            self.input.bind(self.input_addr)
            self.output.bind(self.output_addr)
        else:
            # Loopback only; ports chosen by the OS (no hard-coded ports).
            port_in = self.input.bind_to_random_port("tcp://127.0.0.1")
            port_out = self.output.bind_to_random_port("tcp://127.0.0.1")
            self.input_addr = f"tcp://127.0.0.1:{port_in}"
            self.output_addr = f"tcp://127.0.0.1:{port_out}"
        logger.info("engine transport: input %s, output %s (%s)", self.input_addr,
                    self.output_addr, "CURVE, core key only" if self.keys is not None
                    else "unauthenticated")

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        if self.on_rejected is not None:
            self.on_rejected(reason)

    def _decode(self, frames: list[bytes]) -> EngineCoreOutputs | EngineCoreReady | None:
        """One message from the core, or None (logged and counted) if it is malformed:
        no frame can kill the server."""
        try:
            kind, payload = frames
            if kind == KIND_OUTPUTS:
                return self.outputs_decoder.decode(payload)
            if kind == KIND_READY:
                return self.ready_decoder.decode(payload)
            problem = f"unknown kind {kind[:8]!r}"
        except msgspec.DecodeError as e:  # ValidationError included
            problem = f"undecodable payload ({str(e)[:80]})"
        except ValueError:  # not two frames (DecodeError is a ValueError too)
            problem = f"{len(frames)} frames"
        logger.warning("engine transport: dropped a malformed message (%s)", problem)
        self._reject("malformed")
        return None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 900.0) -> EngineCoreReady:
        """Spawn the core and wait for its ``EngineCoreReady``.

        Raises ``EngineStartupError`` with the core's one-line reason if it fails to start
        or exits before being ready."""
        self._bind()
        mp = multiprocessing.get_context("spawn")
        self.proc = start_process(
            mp, run_engine_core,
            (self.config, self.input_addr, self.output_addr, os.getpid(),
             self.heartbeat_interval, self.keys.core if self.keys else None),
            name="pagedllm-engine-core")
        deadline = time.monotonic() + timeout
        while True:
            if await self.output.poll(int(self.poll_interval * 1000)):
                ready = self._decode(await self.output.recv_multipart())
                if not isinstance(ready, EngineCoreReady):
                    continue
                if not ready.ok:
                    self._join(5.0)
                    raise EngineStartupError(ready.error or "engine core failed to start")
                self.ready = ready
                self.last_message = time.monotonic()
                return ready
            if not self.proc.is_alive():
                raise EngineStartupError(
                    f"engine core exited during start-up (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                self.shutdown()
                raise EngineStartupError(f"engine core not ready after {timeout:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_alive(self) -> bool:
        return self.dead is None and self.proc is not None and self.proc.is_alive()

    def heartbeat_age(self) -> float:
        """Seconds since the core last sent anything (steps and idle heartbeats)."""
        return time.monotonic() - self.last_message

    def _join(self, timeout: float) -> None:
        if self.proc is None:
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout``, then terminate/kill it.  Idempotent
        and safe to call after the core died."""
        if self._closed:
            return
        self._closed = True
        if self.proc is not None and self.proc.is_alive():
            try:
                # A blocking send on a sync shadow socket: works outside the event loop too.
                zmq.Socket.shadow(self.input.underlying).send_multipart(
                    [KIND_SHUTDOWN, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._join(timeout)
        if self._monitor is not None:
            self._monitor.stop()
        if self._auth is not None:
            self._auth.stop()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send sequences in one message (an ``n > 1`` request is admitted as a whole)."""
        self._check_alive()
        await self.input.send_multipart([KIND_ADD, self.encoder.encode(requests)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead is not None:
            return
        await self.input.send_multipart([KIND_ABORT, self.encoder.encode(request_ids)])

    async def get_output(self) -> EngineCoreOutputs:
        """The next ``EngineCoreOutputs`` (heartbeats included: ``outputs`` may be empty).

        Raises ``EngineDeadError`` once the core failed a step or exited."""
        self._check_alive()
        assert self.proc is not None
        while True:
            if await self.output.poll(int(self.poll_interval * 1000)):
                outputs = self._decode(await self.output.recv_multipart())
                if not isinstance(outputs, EngineCoreOutputs):
                    continue  # malformed (dropped) or a stray READY
                self.last_message = time.monotonic()
                if outputs.engine_error is not None:
                    logger.error("engine core failed: %s", outputs.engine_error)
                    self.dead = EngineDeadError(
                        "the engine core failed and is shutting down")
                    raise self.dead
                return outputs
            if not self.proc.is_alive():
                logger.error("engine core process %s exited unexpectedly (exit code %s)",
                             self.proc.pid, self.proc.exitcode)
                self.dead = EngineDeadError("the engine core process died")
                raise self.dead
