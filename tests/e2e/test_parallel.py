"""Tensor and pipeline parallelism on CPU (gloo), the ``mp`` executor: greedy tokens of
TP=2, PP=2 and TP=2 x PP=2 equal TP=1 token for token on the default model in fp32,
batched and with preemption (and with async scheduling); a rank that dies or hangs is
reported naming it and leaves no process behind; a start-up rendezvous that never
completes times out naming the rank.

SmolLM2-135M has 9 query heads in 3 KV groups: at TP=2 the ranks hold 2 and 1 KV heads
(6 and 3 query heads), so the uneven head split is exercised too.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.executor.base import ExecutorError

PROMPTS = ["Question: what is the capital city of France? Answer:",
           "Explain briefly why the sky looks blue during the day:",
           "Bees collect nectar from flowers and turn it into",
           "Write one sentence about prime numbers and why they matter:"]
NEW = 10
MAX_LEN = 64
# SmolLM2-135M in fp32: 30 layers x 2 x 3 KV heads x 64 x 4 B per token, 16 per block.
BLOCK_BYTES = 16 * 46080
POOL_BLOCKS = 6  # 10-12 prompt + 10 new tokens: 2 blocks each, 8 > 6 -> preemption


def _pool_bytes(tp: int, pp: int) -> int:
    """``kv_cache_memory_bytes`` (per rank) that gives every config the same
    ``POOL_BLOCKS`` blocks: the largest rank holds ceil(3 / tp) of the 3 KV heads and
    1/pp of the layers."""
    heads = -(-3 // tp)
    return (POOL_BLOCKS + 1) * BLOCK_BYTES * heads // 3 // pp


def _engine(tp: int = 1, pp: int = 1, **kw) -> LLM:
    return LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, quantization="none",
               max_model_len=MAX_LEN, max_num_batched_tokens=64,
               kv_cache_memory_bytes=_pool_bytes(tp, pp), enable_prefix_caching=False, **kw)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.client.core.executor.procs]


@pytest.fixture(scope="session")  # shared with test_parallel_ray.py
def reference() -> list[list[int]]:
    llm = _engine()
    try:
        ref = _greedy(llm)
        assert llm.llm_engine.client.core.scheduler.total_preemptions > 0
        return ref
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_mp_greedy_equals_tp1_batched_and_preempted(reference, tp: int, pp: int) -> None:
    llm = _engine(tp, pp)
    pids = _worker_pids(llm)
    try:
        core = llm.llm_engine.client.core
        assert core.config.parallel_config.distributed_executor_backend == "mp"
        assert core.num_blocks == POOL_BLOCKS + 1
        assert _greedy(llm) == reference
        assert core.scheduler.total_preemptions > 0
        # Pipeline parallelism: one micro-batch per stage was in flight at once.
        assert core.max_batches_in_flight == (pp if pp > 1 else 0)
        if (tp, pp) == (1, 2):  # a stage dies with micro-batches in flight: reported
            os.kill(pids[0], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match=r"worker rank 0 \(pid \d+\) died"):
                _greedy(llm)
            assert time.monotonic() - t0 < 5
            assert core.max_batches_in_flight == 2
    finally:
        llm.llm_engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_async_scheduling_then_dead_and_hung_ranks_are_reported(reference) -> None:
    # The core schedules step N+1 while the ranks run step N (their answers come back
    # in launch order): same tokens.
    llm = _engine(2, 1, distributed_timeout_seconds=10.0, async_scheduling=True)
    pids = _worker_pids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        assert _greedy(llm) == reference
        os.kill(pids[1], signal.SIGSTOP)  # alive but silent: its collectives never finish
        t0 = time.monotonic()
        # Either the executor's wait or rank 0's own collective times out first.
        with pytest.raises(ExecutorError, match=r"rank 0 (returned no output within 10 s|"
                                                r"failed: .*[Tt]imed out)"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        os.kill(pids[1], signal.SIGCONT)
        llm.llm_engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    llm = _engine(2, 1)
    pids = _worker_pids(llm)
    try:
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match=r"worker rank 1 \(pid \d+\) died"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        llm.llm_engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_startup_rendezvous_times_out_naming_the_rank() -> None:
    from pagedllm.executor.multiproc import free_port
    from pagedllm.worker.worker import Worker

    config = EngineArgs(tensor_parallel_size=2, distributed_executor_backend="mp",
                        distributed_timeout_seconds=2.0, max_model_len=MAX_LEN,
                        quantization="none").create_engine_config()
    worker = Worker(config, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0: joining the 2-rank world"):
        worker.init_device()  # rank 1 never comes
    assert time.monotonic() - t0 < 30


def test_parallel_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds"):
        EngineArgs(pipeline_parallel_size=31).create_engine_config()
    # 49152-token vocabulary and 1536 MLP features do not split five ways.
    with pytest.raises(ValueError, match="tensor_parallel_size 5"):
        EngineArgs(tensor_parallel_size=5).create_engine_config()
    assert EngineArgs(tensor_parallel_size=2).create_engine_config() \
        .parallel_config.distributed_executor_backend == "mp"
