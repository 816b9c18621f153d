"""The engine-core process: ``EngineCore`` behind two ZeroMQ sockets.

::

    API server process                          engine-core process
    ------------------                          -------------------
    PUSH  (binds input_addr)  ── ADD/ABORT ──►  PULL   drain inputs ─┐
                                                                     ▼
    PULL  (binds output_addr) ◄── OUTPUTS ───  PUSH   step() ─ publish outputs
                              ◄── READY (once, after the model is loaded)

Wire format: every message is two frames, ``[kind, payload]``; payloads are msgpack via
msgspec (``EngineCoreRequest`` list, ``list[str]`` of ids, ``EngineCoreOutputs``,
``EngineCoreReady``).  No pickle crosses a socket.  Addresses are ``ipc://`` paths in a
private temp dir or ``tcp://127.0.0.1``: the client binds, the core connects, as a
CURVE client holding the per-launch key that the client's ZAP handler alone admits
(``transport_auth.py``).  A malformed input message is never fatal: a request whose
id can be read is answered with an abort, anything else is logged and dropped.

The loop (``EngineCoreProc.run``):

1. drain the input socket (block up to ``heartbeat_interval`` when idle, never when busy);
2. ``step()`` while there is unfinished work and publish its ``EngineCoreOutputs``
   (stamped with ``timestamp`` = wall time: the client's heartbeat);
3. when idle, publish an empty ``EngineCoreOutputs`` every ``heartbeat_interval`` so the
   API server's ``/health`` can tell "idle" from "stuck";
4. exit when the parent process is gone (``os.getppid()`` changed), so killing the API
   server never leaves an orphan holding the model's memory.

An exception in ``step()`` is fatal: the core sends ``EngineCoreOutputs(engine_error=...)``
(first line only: no traceback or paths leave the process), logs the traceback and exits
with status 1.  A start-up failure is reported in ``EngineCoreReady(error=...)``, exit 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

import pagedllm.envs as envs
from pagedllm.engine.transport_auth import CoreKeys
from pagedllm.gc_heap import freeze_gc_heap
from pagedllm.logger import DATE_FORMAT
from pagedllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from pagedllm.engine.dp_lockstep import DPLockstep

logger = logging.getLogger("pagedllm.engine.core_proc")

# Frame 0 of every message.
KIND_ADD = b"A"
KIND_ABORT = b"X"
KIND_SHUTDOWN = b"S"
KIND_READY = b"R"
KIND_OUTPUTS = b"O"


class EngineCoreReady(msgspec.Struct, omit_defaults=True):
    """The core's first message: what it decided at start-up, or why it could not start."""

    pid: int
    error: str | None = None
    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    max_tokens_per_request: int = 0
    device: str = ""
    dtype: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class _RequestIds(msgspec.Struct):
    """The ids of an ``EngineCoreRequest`` (other fields ignored): enough to answer a
    request whose other fields do not decode."""

    request_id: str
    fork_ids: list[str] = msgspec.field(default_factory=list)


def first_line(e: BaseException) -> str:
    """``Type: first line of message`` -- safe to show a client (no traceback)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class EngineCoreProc:
    """Runs one ``EngineCore`` and its sockets; see the module doc for the protocol."""

    def __init__(self, core: Any, input_addr: str, output_addr: str, parent_pid: int,
                 heartbeat_interval: float = 0.5, keys: CoreKeys | None = None) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.heartbeat_interval = heartbeat_interval
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = self.ctx.socket(zmq.PUSH)
        # Outputs must survive until the client reads them, even on exit (error frames).
        self.output.setsockopt(zmq.LINGER, 5000)
        if keys is not None:  # CURVE client of the API server (transport_auth.py)
            keys.secure(self.input)
            keys.secure(self.output)
        self.input.connect(input_addr)
        self.output.connect(output_addr)
        self.num_malformed = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.add_decoder = msgspec.msgpack.Decoder(list[EngineCoreRequest])
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        # Lenient decoders: when an ADD batch fails the typed decode, answer what can be.
        self.raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self.one_add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_decoder = msgspec.msgpack.Decoder(_RequestIds)
        self.last_publish = 0.0
        self.stop = False
        # Experts across data-parallel engines: the engines' step lockstep.
        self.lockstep: DPLockstep | None = None

    # ------------------------------------------------------------------ sending

    def send_ready(self, ready: EngineCoreReady) -> None:
        self.output.send_multipart([KIND_READY, self.encoder.encode(ready)])

    def publish(self, outputs: EngineCoreOutputs) -> None:
        outputs.timestamp = time.time()
        self.output.send_multipart([KIND_OUTPUTS, self.encoder.encode(outputs)])
        self.last_publish = time.monotonic()

    # ------------------------------------------------------------------ receiving

    def _handle(self, frames: list[bytes]) -> bool:
        """Apply one input message; returns True if it was an abort (stats changed).
        A malformed message is logged and dropped, never fatal."""
        try:
            return self._apply(frames)
        except (ValueError, msgspec.DecodeError) as e:  # wrong frame count, bad payload
            self.num_malformed += 1
            logger.warning("dropped a malformed input message (%s; %d so far)",
                           first_line(e), self.num_malformed)
            return False

    def _decode_adds(self, payload: bytes,
                     rejected: list[EngineCoreOutput]) -> list[EngineCoreRequest]:
        """The requests of an ADD payload.  When the batch does not decode, each entry is
        decoded alone; an entry that still fails but whose ids can be read is answered
        (an ABORT in ``rejected``) rather than dropped.  ``msgspec.DecodeError`` only
        when no entry can be read at all."""
        try:
            return self.add_decoder.decode(payload)
        except msgspec.DecodeError as e:
            entries = self.raw_list_decoder.decode(payload)  # DecodeError: unreadable
            error = first_line(e)
        good: list[EngineCoreRequest] = []
        for raw in entries:
            try:
                good.append(self.one_add_decoder.decode(raw))
                continue
            except msgspec.DecodeError as e:
                error = first_line(e)
            try:
                ids = self.ids_decoder.decode(raw)
            except msgspec.DecodeError:
                self.num_malformed += 1
                logger.warning("dropped a malformed request without an id (%s; %d so far)",
                               error, self.num_malformed)
                continue
            self.num_malformed += 1
            logger.warning("request %s is malformed, answered with an abort: %s",
                           ids.request_id, error)
            rejected.extend(EngineCoreOutput(
                request_id=sid, new_token_ids=[], finish_reason=FinishReason.ABORT)
                for sid in (ids.request_id, *ids.fork_ids))
        return good

    def _apply(self, frames: list[bytes]) -> bool:
        kind, payload = frames
        if kind == KIND_ADD:
            rejected: list[EngineCoreOutput] = []
            for req in self._decode_adds(payload, rejected):
                try:
                    self.core.add_request(req)
                except Exception as e:  # noqa: BLE001 - answered, never dropped
                    # The frontend validates first; if the core still refuses, finish the
                    # request (abort) rather than leave the client waiting forever.
                    logger.warning("request %s rejected by the engine core: %s",
                                   req.request_id, first_line(e))
                    rejected.extend(EngineCoreOutput(
                        request_id=sid, new_token_ids=[], finish_reason=FinishReason.ABORT)
                        for sid in (req.request_id, *req.fork_ids))
            if rejected:
                self.publish(EngineCoreOutputs(outputs=rejected))
            return False
        if kind == KIND_ABORT:
            self.core.abort_requests(self.abort_decoder.decode(payload))
            return True
        if kind == KIND_SHUTDOWN:
            self.stop = True
            return False
        raise ValueError(f"unknown message kind {kind[:8]!r}")

    def drain_inputs(self, timeout_ms: int) -> bool:
        """Handle every queued input; wait up to ``timeout_ms`` for the first one.

        Returns True when an abort arrived (so fresh stats are worth publishing)."""
        aborted = False
        if timeout_ms > 0 and not self.input.poll(timeout_ms):
            return False
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return aborted
            aborted |= self._handle(frames)

    # ------------------------------------------------------------------ loop

    def parent_alive(self) -> bool:
        # Re-parenting (to init or a subreaper) is how Linux tells us the parent died.
        return os.getppid() == self.parent_pid

    def _idle_stats(self) -> SchedulerStats | None:
        make = getattr(self.core, "make_stats", None) or getattr(
            getattr(self.core, "scheduler", None), "make_stats", None)
        return make() if callable(make) else None

    def run(self) -> int:
        """The busy loop; returns the process exit status."""
        if self.lockstep is not None:
            return self._run_lockstep(self.lockstep)
        while not self.stop:
            if not self.parent_alive():
                logger.error("API server process %d is gone; engine core exiting",
                             self.parent_pid)
                return 1
            busy = self.core.has_unfinished_requests()
            aborted = self.drain_inputs(0 if busy else int(self.heartbeat_interval * 1000))
            if self.stop:
                break
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                self.publish(outputs)
            elif aborted or time.monotonic() - self.last_publish >= self.heartbeat_interval:
                # Heartbeat; after aborts it also carries the freed-blocks snapshot.
                self.publish(EngineCoreOutputs(scheduler_stats=self._idle_stats()))
        return 0

    def _run_lockstep(self, lockstep: DPLockstep) -> int:
        """The busy loop when experts span the data-parallel engines: every engine syncs
        once per iteration and, when any engine has work, runs exactly one step --
        an empty one when it has none (``engine/dp_lockstep.py``)."""
        while True:
            if not self.parent_alive():
                logger.error("API server process %d is gone; engine core exiting",
                             self.parent_pid)
                self.stop = True
            busy = self.core.has_unfinished_requests()
            aborted = False
            if not self.stop:
                aborted = self.drain_inputs(0 if busy else int(lockstep.idle_poll_s * 1000))
            anyone_busy, anyone_stopping = lockstep.sync(
                self.core.has_unfinished_requests(), self.stop)
            if anyone_stopping:
                return 0 if self.parent_alive() else 1
            if anyone_busy:
                outputs = self.core.step()
                if outputs.outputs or self.core.has_unfinished_requests() or aborted:
                    self.publish(outputs)
                    continue
            if aborted or time.monotonic() - self.last_publish >= self.heartbeat_interval:
                self.publish(EngineCoreOutputs(scheduler_stats=self._idle_stats()))

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def _join_lockstep(proc: EngineCoreProc, core: Any) -> str | None:
    """Experts across data-parallel engines (``core.lockstep``): give ``proc`` its seat
    in the engines' step lockstep.  Returns why it could not join (one line: a port
    taken meanwhile, another engine that never came), else None.  (Run outside the
    start-up ``try`` of ``run_engine_core``, whose ``os._exit`` would swallow the
    exception unreported.)"""
    if not getattr(core, "lockstep", False):
        return None
    from pagedllm.engine.dp_lockstep import DPLockstep

    try:
        proc.lockstep = DPLockstep(core.config.parallel_config)
    except Exception as e:
        logger.exception("engine core failed to join the data-parallel step lockstep")
        return f"joining the data-parallel engines' step lockstep failed: {first_line(e)}"
    logger.info("data-parallel engine %d of %d: experts span every engine, so the "
                "engines step in lockstep", proc.lockstep.rank, proc.lockstep.size)
    return None


def _setup_logging() -> None:
    logging.basicConfig(
        level=envs.logging_level(),
        format=f"%(levelname)s %(asctime)s [EngineCore pid={os.getpid()}] %(message)s",
        datefmt=DATE_FORMAT,
        stream=sys.stderr)


def run_engine_core(config: Any, input_addr: str, output_addr: str, parent_pid: int,
                    heartbeat_interval: float = 0.5, keys: CoreKeys | None = None) -> None:
    """Process entry point (multiprocessing spawn target).  ``config`` is an
    ``EngineConfig``, or the ``EngineArgs`` to build it from here (so that the parent
    need not build it before spawning).  Exits 0 on a requested shutdown, 1 on a
    start-up failure, a step error or parent death."""
    _setup_logging()
    # Start-up timeline: this line, the imports, the config, then "loaded ... in X s"
    # and "engine ready" (docs/findings.md, "Start-up", breaks a start-up down by them).
    logger.info("engine core process started; loading torch and the model")
    t0 = time.perf_counter()
    # The API server handles SIGINT/SIGTERM and tells us to stop; a Ctrl-C on the terminal
    # reaches the whole process group, so ignore it here instead of dying mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    proc: EngineCoreProc | None = None
    status = 1
    warmup = None
    try:
        from pagedllm.engine.arg_utils import EngineArgs

        if isinstance(config, EngineArgs):
            # Before torch: a helper compiles the Triton kernels while this process
            # imports torch and transformers (engine/kernel_warmup.py).
            from pagedllm.engine import kernel_warmup

            warmup = kernel_warmup.start(config)
            if warmup is not None:
                logger.info("kernel warm-up helper started (pid %d)", warmup.proc.pid)
        from pagedllm.engine.core import EngineCore

        t1 = time.perf_counter()
        logger.info("imported the engine core's modules in %.1f s", t1 - t0)
        try:
            if isinstance(config, EngineArgs):  # spawned before the parent built its copy
                config = config.create_engine_config()  # logs its own time
            if warmup is not None:  # its CUDA context must be gone before the memory plan
                warmup.wait()
                warmup = None
            core = EngineCore(config)
        except Exception as e:  # report why start-up failed, in one line
            reason = first_line(e)
            if isinstance(e, ValueError):
                # A user error (flags, model file, too little memory), said once: the API
                # server prints this line as its reason (and if the config itself was
                # bad, its own copy of the same error first).  No traceback.
                lines = str(e).strip().splitlines()
                reason = lines[0] if lines else reason
            else:
                logger.exception("engine core failed to start")
            proc = EngineCoreProc(None, input_addr, output_addr, parent_pid, keys=keys)
            proc.send_ready(EngineCoreReady(pid=os.getpid(), error=reason))
            return
        proc = EngineCoreProc(core, input_addr, output_addr, parent_pid, heartbeat_interval,
                              keys)
        error = _join_lockstep(proc, core)
        if error is not None:  # said as a start-up failure, not a silent exit
            proc.send_ready(EngineCoreReady(pid=os.getpid(), error=error))
            try:
                core.shutdown()
            except Exception:  # already failing: the reason above is the one to report
                logger.exception("engine core shutdown failed")
            return
        freeze_gc_heap("engine core")
        cc = getattr(core, "config", config)
        proc.send_ready(EngineCoreReady(
            pid=os.getpid(), num_blocks=int(getattr(core, "num_blocks", 0) or 0),
            block_size=int(cc.cache_config.block_size),
            max_model_len=int(getattr(core, "max_model_len", 0)
                              or cc.model_config.max_model_len),
            max_num_seqs=int(cc.scheduler_config.max_num_seqs),
            max_tokens_per_request=int(getattr(core, "max_tokens_per_request", 0) or 0),
            device=str(cc.device_config.device), dtype=str(cc.model_config.dtype)))
        try:
            status = proc.run()
        except Exception as e:
            logger.exception("engine core step failed")
            proc.publish(EngineCoreOutputs(engine_error=first_line(e)))
            status = 1
        try:
            core.shutdown()
        except Exception:  # shutting down after an error: nothing more to report
            logger.exception("engine core shutdown failed")
    finally:
        if warmup is not None and warmup.proc.poll() is None:  # start-up failed early
            warmup.proc.kill()
        if proc is not None:
            proc.close()
        # Skip interpreter teardown (atexit of torch / multiprocessing) once done.
        logging.shutdown()
        os._exit(status)
