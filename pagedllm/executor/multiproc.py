"""The ``mp`` executor: one spawned worker process per rank on this host.

The protocol is in ``worker_proc.py``.  The engine core broadcasts each step once (an
XPUB socket: every rank's SUB gets the same frames; ZeroMQ copies nothing per
subscriber on ``ipc://``) and reads the output rank's answer.  Sockets live in a private
0700 temporary directory; the rendezvous of ``torch.distributed`` is a loopback TCP port
the OS picks.

Failure detection: waiting for a message polls in short slices and checks between them
that every rank's process is alive, so a dead rank is reported within
``POLL_INTERVAL`` seconds; a rank's own failure report (``F``) is raised at once; a step
with no answer after ``distributed_timeout_seconds`` is a hang.  Every case raises
``ExecutorError`` naming the rank, after which the executor is unusable and
``shutdown()`` terminates whatever is left.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor, ExecutorError, output_rank
from pagedllm.executor.process_start import free_port, start_process
from pagedllm.executor.worker_proc import (
    ENCODER,
    KIND_CACHE_READY,
    KIND_EXECUTE,
    KIND_FAILURE,
    KIND_INIT_CACHE,
    KIND_OUTPUT,
    KIND_READY,
    KIND_SHUTDOWN,
    OUTPUT_DECODER,
    SampledTokens,
    WorkerCacheReady,
    WorkerReady,
    run_worker,
)

logger = logging.getLogger("pagedllm")

POLL_INTERVAL = 0.2


def rank_context(config: EngineConfig) -> multiprocessing.context.BaseContext:
    """How ranks are started: forked from a fork server that has imported what a rank
    needs (torch, the model code, the model's transformers config class) once.

    A spawned rank imports all of that itself, and on CPU that is most of its start-up
    (two ranks importing at once on two cores took 28 s of a 54 s TP=2 start-up here,
    docs/benchmarks.md).  The fork server never runs a torch op, opens a socket or starts
    a thread, so forking it is safe where forking the engine core (ZeroMQ context,
    OpenMP pool, read-ahead threads, CUDA) is not; it exits when the core does."""
    ctx = multiprocessing.get_context("forkserver")
    hf_cls = type(config.model_config.hf_config)
    ctx.set_forkserver_preload(["pagedllm.executor.worker_proc", "pagedllm.worker.worker",
                                hf_cls.__module__])
    return ctx


@dataclass
class _Pending:
    executor: MultiprocExecutor
    seq: int
    out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        while self.out is None:
            self.executor._read_output()
        return self.out


class MultiprocExecutor(Executor):
    """See the module doc."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.timeout = pc.distributed_timeout_seconds
        self.output_rank = output_rank(config)
        self._closed = False
        self.failed: ExecutorError | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-exec-")
        self.ctx = zmq.Context(io_threads=1)
        self.bcast = self.ctx.socket(zmq.XPUB)
        self.bcast.setsockopt(zmq.LINGER, 0)
        self.bcast.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self.bcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        bcast_addr = f"ipc://{self._tmpdir}/broadcast"
        result_addr = f"ipc://{self._tmpdir}/results"
        self.bcast.bind(bcast_addr)
        self.results.bind(result_addr)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp = rank_context(config)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.ctx,
                                           [self.bcast, self.results], self._tmpdir)
        self._launched = 0
        self._received = 0
        self._pending: dict[int, _Pending] = {}
        # Pipeline parallelism: tokens read since the last launch, for the early stages.
        self._sampled: SampledTokens | None = SampledTokens() \
            if pc.pipeline_parallel_size > 1 else None
        try:
            for rank in range(self.world_size):
                self.procs.append(start_process(
                    mp, run_worker, (config, rank, rank, init_method, bcast_addr,
                                     result_addr, os.getpid(), rank == self.output_rank,
                                     time.time()),
                    name=f"pagedllm-worker-{rank}", daemon=True))
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up

    def _start(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        # Start-up (rendezvous, model load) may take longer than one step: the timeout
        # applies to each rank's silence, and the ranks' own collectives time out too.
        ready = self._gather(KIND_READY, msgspec.msgpack.Decoder(WorkerReady),
                             "load the model and size its KV cache",
                             self.timeout + 600.0)
        self._await_subscriptions()
        self.num_blocks = min(r.num_blocks for r in ready.values())
        # Per rank: where its start-up went (WorkerReady.startup_s), for the log and
        # ``pagedllm bench parallel``.
        self.rank_startup_s = [ready[r].startup_s for r in sorted(ready)]
        logger.info("%d ranks ready in %.1f s; KV blocks per rank %s -> %d; start-up of "
                    "rank 0: %s", self.world_size, time.perf_counter() - t0,
                    [ready[r].num_blocks for r in sorted(ready)], self.num_blocks,
                    ", ".join(f"{k} {v:.1f} s" for k, v in self.rank_startup_s[0].items()))
        self.bcast.send_multipart([KIND_INIT_CACHE, ENCODER.encode(self.num_blocks)])
        caches = self._gather(KIND_CACHE_READY, msgspec.msgpack.Decoder(WorkerCacheReady),
                              "allocate its KV cache", self.timeout + 600.0)
        self.config = config.with_num_blocks(self.num_blocks)
        out = caches[self.output_rank]
        self.num_cpu_blocks = out.num_cpu_blocks
        self.fill_step_sizes = list(out.fill_step_sizes)
        self.step_cost = out.step_cost

    def _await_subscriptions(self) -> None:
        """Every rank's SUB is connected before the first broadcast (else PUB drops)."""
        seen, deadline = 0, time.monotonic() + self.timeout
        while seen < self.world_size:
            if self.bcast.poll(int(POLL_INTERVAL * 1000)):
                msg = self.bcast.recv()
                seen += msg[:1] == b"\x01"
            elif time.monotonic() > deadline:
                raise ExecutorError(f"only {seen} of {self.world_size} ranks subscribed "
                                    f"to the step broadcast within {self.timeout:.0f} s")

    def _gather(self, kind: bytes, decoder: msgspec.msgpack.Decoder, what: str,
                timeout: float) -> dict[int, object]:
        """One ``kind`` message from every rank, or ``ExecutorError`` naming the first
        rank that failed, died or stayed silent for ``timeout`` seconds."""
        got: dict[int, object] = {}
        last = time.monotonic()
        while len(got) < self.world_size:
            frames = self._poll(lambda t=last: time.monotonic() - t > timeout)
            if frames is None:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise self._fail(f"rank {missing[0]} did not {what} within {timeout:.0f} "
                                 f"s (ranks still silent: {missing})")
            k, rank, payload = frames
            if k == kind:
                got[int(rank)] = decoder.decode(payload)
                last = time.monotonic()
        return got

    # ------------------------------------------------------------------ messages

    def _poll(self, expired: Callable[[], bool]) -> list[bytes] | None:
        """The next message from a rank; None once ``expired()``; ``ExecutorError`` when
        a rank reported a failure or its process died."""
        while True:
            if self.results.poll(int(POLL_INTERVAL * 1000)):
                frames = self.results.recv_multipart()
                if frames[0] == KIND_FAILURE:
                    # A rank's collective fails when a peer is killed: name the killed
                    # peer (the cause) if there is one, else the failing rank and why
                    # (failing ranks exit with status 1 by themselves).
                    deadline = time.monotonic() + 1.0
                    while time.monotonic() < deadline:
                        for rank, p in enumerate(self.procs):
                            if p.exitcode is not None and p.exitcode < 0:
                                raise self._fail(f"worker rank {rank} (pid {p.pid}) died "
                                                 f"(exit code {p.exitcode})")
                        time.sleep(0.05)
                    raise self._fail(f"rank {int(frames[1])} failed: "
                                     f"{frames[2].decode(errors='replace')}")
                return frames
            self.check_health()
            if expired():
                return None

    def _fail(self, msg: str) -> ExecutorError:
        self.failed = ExecutorError(msg)
        logger.error("executor: %s", msg)
        return self.failed

    def check_health(self) -> None:
        if self.failed is not None:
            raise self.failed
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                raise self._fail(f"worker rank {rank} (pid {p.pid}) died "
                                 f"(exit code {p.exitcode})")

    def _read_output(self) -> None:
        """Receive the next step's output (steps answer in launch order)."""
        start = time.monotonic()
        frames = self._poll(lambda: time.monotonic() - start > self.timeout)
        if frames is None:
            raise self._fail(f"rank {self.output_rank} returned no output within "
                             f"{self.timeout:.0f} s: a rank is hung")
        if frames[0] != KIND_OUTPUT:
            return
        pending = self._pending.pop(self._received)
        self._received += 1
        pending.out = OUTPUT_DECODER.decode(frames[2])
        if self._sampled is not None:
            self._sampled.add(pending.out)

    # ------------------------------------------------------------------ steps

    def execute_model_async(self, sched: SchedulerOutput) -> _Pending:
        if self.failed is not None:
            raise self.failed
        frames = [KIND_EXECUTE, ENCODER.encode(sched)]
        if self._sampled is not None:
            frames.append(ENCODER.encode(self._sampled))
            self._sampled = SampledTokens()
        self.bcast.send_multipart(frames)
        handle = _Pending(self, self._launched)
        self._pending[self._launched] = handle
        self._launched += 1
        return handle

    def shutdown(self) -> None:
        """Ask every rank to stop, then terminate/kill what is left (idempotent; also
        run when the executor is garbage-collected or the interpreter exits)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.bcast.send_multipart([KIND_SHUTDOWN, b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._finalizer()


def _stop(procs: list[multiprocessing.process.BaseProcess], ctx: zmq.Context,
          sockets: list[zmq.Socket], tmpdir: str) -> None:
    """Join the ranks for a few seconds, then terminate and kill the rest; close the
    sockets.  Holds no reference to the executor (a ``weakref.finalize`` callback)."""
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for s in sockets:
        s.close(linger=0)
    ctx.term()
    shutil.rmtree(tmpdir, ignore_errors=True)
