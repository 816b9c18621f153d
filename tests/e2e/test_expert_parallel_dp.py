"""Expert parallelism across data-parallel engines through the whole engine on CPU:
``data_parallel_size=2`` with ``enable_expert_parallel`` places each MoE layer's experts
on both engines' ranks (EP size = DP x TP), the engine cores step in lockstep and an
engine without requests runs empty steps whose ranks still serve the other engine's
tokens.  Greedy tokens equal one rank's (the offline ``LLM``) on tiny random MoE
checkpoints, for both token-dispatch backends, with the two engines holding different
numbers of requests, with one engine idle the whole time, and with TP inside each engine;
the configurations it cannot serve are refused naming the parameter."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.e2e.test_expert_parallel import BUILDERS, NEW, _greedy, _prompts
from tests.models.tiny_models import build


async def _serve(path: str, prompts: list[list[int]], **kw) -> tuple[list[list[int]], str]:
    """Greedy tokens of ``prompts`` sent at once to two EP engines, and the engines'
    assignment (which engine got each request)."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.dp_client import DPClient

    args = EngineArgs(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32",
                      max_model_len=64, max_num_batched_tokens=24,
                      kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False,
                      data_parallel_size=2, enable_expert_parallel=True, **kw)
    llm = await AsyncLLM.create(args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

        async def one(i: int, p: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in llm.generate({"prompt_token_ids": p}, params, f"r{i}"):
                tokens += out.outputs[0].token_ids  # streams carry deltas
            return tokens

        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        assert isinstance(llm.client, DPClient)
        return list(got), str(llm.client.assigned)
    finally:
        await llm.shutdown()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("arch", "backend"), [("deepseek_v3", "allgather_reducescatter"),
                                               ("qwen2_moe", "alltoall")])
def test_dp2_expert_parallel_equals_one_rank(arch: str, backend: str, tmp_path) -> None:
    path = str(tmp_path)
    BUILDERS[arch](path)
    prompts = _prompts()
    ref = _greedy(path)
    got, assigned = asyncio.run(_serve(path, prompts, all2all_backend=backend))
    assert got == ref, assigned
    assert assigned == "[2, 1]"  # different loads; the second engine idles early
    # One request: the other engine is idle throughout and only serves its experts.
    got, assigned = asyncio.run(_serve(path, prompts[1:2], all2all_backend=backend))
    assert got == ref[1:2] and assigned == "[1, 0]"


@pytest.mark.timeout(900)
def test_dp2_tp2_expert_parallel_equals_one_rank(tmp_path) -> None:
    """Four ranks: two engines of two TP ranks, experts over all four."""
    path = str(tmp_path)
    BUILDERS["mixtral"](path)
    prompts = _prompts()
    got, _ = asyncio.run(_serve(path, prompts, tensor_parallel_size=2,
                                all2all_backend="alltoall"))
    assert got == _greedy(path)


def test_expert_parallel_across_engines_refusals(tmp_path) -> None:
    moe, dense = str(tmp_path / "moe"), str(tmp_path / "dense")
    build("qwen2_moe", moe)  # 6 routed experts
    build("mistral_sw", dense)

    def config(model: str = moe, **kw):
        kw = {"device": "cpu", "data_parallel_size": 2, "enable_expert_parallel": True,
              **kw}
        return EngineArgs(model=model, **kw).create_engine_config()

    cfg = config()  # one rank per engine: EP size 2 over the engines
    pc = cfg.parallel_config
    assert pc.expert_parallel_spans_dp and pc.world_size == 1
    # The engines step in lockstep, one eager forward each per step.
    assert not cfg.scheduler_config.async_scheduling and cfg.device_config.enforce_eager
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        config(dense)
    with pytest.raises(ValueError, match=r"6 routed experts do not divide over the "
                                         r"expert-parallel size 4"):
        config(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        config(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        config(async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config"):
        config(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="runner 'pooling' does not run with enable_exp"):
        config(runner="pooling")
    with pytest.raises(ValueError, match="all2all_backend"):
        config(all2all_backend="deepep")
    with pytest.raises(ValueError, match="enable_expert_parallel spreads experts"):
        config(data_parallel_size=1)
    # A rank of such an engine without the DP client's rendezvous port: named, at once.
    from pagedllm.worker.worker import Worker

    with pytest.raises(ValueError, match="data_parallel_master_port is not set"):
        Worker(cfg)
    # The offline LLM runs one engine: refused rather than waiting for a second one.
    from pagedllm import LLM

    with pytest.raises(ValueError, match="data_parallel_size 2: the offline LLM runs one"):
        LLM(moe, device="cpu", data_parallel_size=2, enable_expert_parallel=True)


def test_all2all_backend_cli_flag() -> None:
    import argparse

    from pagedllm.entrypoints.engine_cli_args import add_parallel_args

    p = argparse.ArgumentParser()
    add_parallel_args(p)
    assert p.parse_args([]).all2all_backend == "allgather_reducescatter"
    assert p.parse_args(["--all2all-backend", "alltoall"]).all2all_backend == "alltoall"
    help_text = " ".join(p.format_help().split())  # argparse wraps lines
    assert "--all2all-backend" in help_text and "Default: allgather_reducescatter" in help_text


@pytest.mark.timeout(300)
def test_a_killed_engine_fails_the_others_promptly(tmp_path) -> None:
    """Experts span both engines, so when one dies the other cannot go on: the running
    requests end with an error at once (not after the distributed timeout), and shutdown
    leaves no engine process behind."""
    import os
    import signal
    import time

    import psutil

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.mp_client import EngineDeadError

    path = str(tmp_path)
    BUILDERS["qwen2_moe"](path)

    async def go() -> tuple[list[str], float, list[int]]:
        llm = await AsyncLLM.create(EngineArgs(
            model=path, skip_tokenizer_init=True, device="cpu", dtype="float32",
            max_model_len=256, enable_prefix_caching=False, data_parallel_size=2,
            enable_expert_parallel=True))
        pids = [int(p) for p in llm.client.pids]
        params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)

        async def one(i: int) -> str:
            started.set()
            try:
                async for _ in llm.generate({"prompt_token_ids": [5, 6, 7]}, params, f"r{i}"):
                    pass
            except EngineDeadError as e:
                return str(e)
            return "finished"

        started = asyncio.Event()
        tasks = [asyncio.create_task(one(i)) for i in range(2)]
        await started.wait()
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        waited = time.monotonic() - t0
        await llm.shutdown()
        return results, waited, pids

    results, waited, pids = asyncio.run(go())
    assert all("engine" in r and r != "finished" for r in results), results
    assert waited < 20  # the distributed timeout is 60 s
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)
