"""A worker rank in its own process (the ``mp`` executor's ranks).

Wire protocol (msgpack via msgspec; no pickle crosses a socket)::

    engine core                                  worker rank r (one per process)
    XPUB (binds) ── [kind, payload] broadcast ─► SUB   C: init cache (num_blocks)
                                                       E: execute (SchedulerOutput
                                                          [, SampledTokens with PP])
                                                       S: shut down
    PULL (binds) ◄── [kind, rank, payload] ──── PUSH  R: ready (WorkerReady)
                                                       K: cache ready (WorkerCacheReady)
                                                       O: ModelRunnerOutput (output rank)
                                                       F: failure (one line), then exit 1

Start-up: connect, join the world (``Worker.init_device``: a rendezvous and a barrier
that time out naming the rank), load the model, size the KV cache -> ``R``; wait for
``C`` with the minimum over ranks -> allocate -> ``K``; then serve ``E`` until ``S``.
A worker exits when its parent (the engine core, or the fork server that exits with it)
is gone, so killing the core never leaves ranks behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

import pagedllm.envs as envs
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm")

KIND_INIT_CACHE = b"C"
KIND_EXECUTE = b"E"
KIND_SHUTDOWN = b"S"
KIND_READY = b"R"
KIND_CACHE_READY = b"K"
KIND_OUTPUT = b"O"
KIND_FAILURE = b"F"


class WorkerReady(msgspec.Struct):
    pid: int
    num_blocks: int
    # Where the rank's start-up went, in seconds: spawn (process start to this module's
    # entry point), import (the worker's modules: torch...), init (joining the world),
    # load (the model), profile (sizing the KV cache).
    startup_s: dict[str, float] = {}


class WorkerCacheReady(msgspec.Struct):
    num_cpu_blocks: int
    fill_step_sizes: list[int]
    step_cost: dict[str, Any] | None = None  # Worker.step_cost_curve


class SampledTokens(msgspec.Struct):
    """Pipeline parallelism: the tokens in the outputs the engine core has read since
    the last step it launched, sent along with the next one so that the stages before
    the last (which never sample) record them first (``worker/pipeline.py``)."""

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []

    def add(self, out: ModelRunnerOutput) -> None:
        self.req_ids.extend(out.req_ids)
        self.sampled_token_ids.extend(out.sampled_token_ids)


ENCODER = msgspec.msgpack.Encoder()
SAMPLED_DECODER = msgspec.msgpack.Decoder(SampledTokens)
SCHED_DECODER = msgspec.msgpack.Decoder(SchedulerOutput)
OUTPUT_DECODER = msgspec.msgpack.Decoder(ModelRunnerOutput)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def run_worker(config: Any, rank: int, local_rank: int, init_method: str,
               broadcast_addr: str, result_addr: str, parent_pid: int,
               is_output_rank: bool, spawned_at: float = 0.0) -> None:
    """Process entry point (multiprocessing spawn target); never returns.
    ``spawned_at``: the parent's ``time.time()`` when it started the process."""
    spawn_s = time.time() - spawned_at if spawned_at else 0.0
    # The process to outlive: the engine core (``parent_pid``) or the fork server it
    # started us from, which exits with it (multiproc.py).
    parent_pid = os.getppid()
    logging.basicConfig(level=envs.logging_level(),
                        format=f"%(levelname)s %(asctime)s [rank {rank} pid={os.getpid()}]"
                        " %(message)s", stream=sys.stderr)
    # Ctrl-C reaches the whole process group: the engine core decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context(io_threads=1)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(broadcast_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)  # a failure report must reach the core
    push.connect(result_addr)
    me = str(rank).encode()
    status = 1
    try:
        status = _serve(config, rank, local_rank, init_method, sub, push, me, parent_pid,
                        is_output_rank, spawn_s)
    except Exception as e:  # report in one line, log the traceback here
        logger.exception("rank %d failed", rank)
        push.send_multipart([KIND_FAILURE, me, first_line(e).encode()])
    finally:
        sub.close(linger=0)
        push.close()
        ctx.term()
        logging.shutdown()
        os._exit(status)


def _recv(sub: zmq.Socket, parent_pid: int) -> list[bytes]:
    """The next broadcast; exits the process if the engine core is gone."""
    while not sub.poll(1000):
        if os.getppid() != parent_pid:
            logger.error("parent process %d (the engine core or its fork server) is gone;"
                         " worker exiting", parent_pid)
            os._exit(1)
    return sub.recv_multipart()


def _serve(config: Any, rank: int, local_rank: int, init_method: str, sub: zmq.Socket,
           push: zmq.Socket, me: bytes, parent_pid: int, is_output_rank: bool,
           spawn_s: float) -> int:
    times = {"spawn": spawn_s}
    t = time.perf_counter()

    def lap(what: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[what], t = now - t, now

    from pagedllm.worker.worker import Worker

    lap("import")
    worker = Worker(config, rank, local_rank, init_method)
    worker.init_device()
    lap("init")
    worker.load_model()
    lap("load")
    num_blocks = worker.determine_num_blocks()
    lap("profile")
    push.send_multipart([KIND_READY, me, ENCODER.encode(
        WorkerReady(os.getpid(), num_blocks, times))])
    while True:
        kind, payload = _recv(sub, parent_pid)
        if kind == KIND_SHUTDOWN:
            worker.shutdown()
            return 0
        if kind == KIND_INIT_CACHE:
            worker.initialize_cache(msgspec.msgpack.decode(payload, type=int))
            push.send_multipart([KIND_CACHE_READY, me, ENCODER.encode(WorkerCacheReady(
                worker.num_cpu_blocks, worker.fill_step_sizes(),
                worker.step_cost_curve()))])
            break
    while True:
        kind, payload, *sampled = _recv(sub, parent_pid)
        if kind == KIND_EXECUTE:
            if sampled:
                s = SAMPLED_DECODER.decode(sampled[0])
                worker.record_sampled_tokens(s.req_ids, s.sampled_token_ids)
            out = worker.execute_model(SCHED_DECODER.decode(payload))
            if is_output_rank:  # only it answers: the others' tokens are identical
                push.send_multipart([KIND_OUTPUT, me, ENCODER.encode(out)])
        elif kind == KIND_SHUTDOWN:
            worker.shutdown()
            return 0
