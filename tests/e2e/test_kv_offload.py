"""The prefix cache's host tier (``kv_offload_bytes``) on the real default model (CPU,
fp32), with a device pool too small for three conversations: greedy outputs equal prefix
caching off token for token, later turns hit on the host where the device alone misses,
an evicted block's bytes come back unchanged, and bad values are ValueErrors naming
``kv_offload_bytes``."""

from __future__ import annotations

import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.e2e.test_hybrid_kv_greedy import BLOCK_BYTES as BLOCK_BYTES_HYBRID
from tests.e2e.test_hybrid_kv_greedy import GREEDY, _llm, _prompts, model  # noqa: F401

BLOCK_BYTES = 16 * 46080  # SmolLM2-135M, fp32: 30 layers x 2 x 3 heads x 64 x 4 B
NEW = 4


def tiny(**kw) -> LLM:
    # 8 usable blocks (128 tokens): one conversation's turn holds 4.
    return LLM(kv_cache_memory_bytes=9 * BLOCK_BYTES, max_model_len=112,
               max_num_batched_tokens=128, quantization="none", **kw)


def history(c: int) -> list[int]:
    return [1000 + 37 * c + 11 * i for i in range(48)]


def turns(llm: LLM, on_turn=None) -> tuple[list[list[int]], list[int]]:
    """Three conversations, two turns each, round-robin, one request at a time: the
    second turn's prompt is the first's plus its answer plus 12 new tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [history(c) for c in range(3)]
    outs, cached = [], []
    for t in range(2):
        for c in range(3):
            o = llm.generate([{"prompt_token_ids": prompts[c]}], sp, use_tqdm=False)[0]
            toks = list(o.outputs[0].token_ids)
            outs.append(toks)
            cached.append(o.num_cached_tokens)
            prompts[c] = prompts[c] + toks + [2000 + 5 * c + i for i in range(12)]
            if on_turn is not None:
                on_turn(t, c)
    return outs, cached


def _core(llm: LLM):
    return llm.llm_engine.client.core


def _block(caches: list[torch.Tensor], i: int) -> torch.Tensor:
    return torch.stack([kv[:, i] for kv in caches])


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The conversations' greedy answers with prefix caching off."""
    llm = tiny(enable_prefix_caching=False)
    try:
        return turns(llm)[0]
    finally:
        llm.llm_engine.shutdown()


def test_tier_equals_caching_off_hits_and_round_trips_bitwise(reference) -> None:
    ref = reference
    dev_out, dev_cached = turns(tiny())
    llm = tiny(kv_offload_bytes=32 * BLOCK_BYTES)
    core = _core(llm)
    sched, worker = core.scheduler, core.executor.worker
    tier = sched.offload
    assert tier is not None and tier.num_host_blocks == 32
    saved: dict[object, torch.Tensor] = {}

    def on_turn(t: int, c: int) -> None:
        if (t, c) == (0, 0):  # conversation 0's blocks, as computed
            for key, b in sched.kv.pool.cached_blocks.items():
                saved[key] = _block(worker.kv_caches, b.block_id).clone()
        if (t, c) == (0, 2):  # evicted by conversations 1 and 2: on the host, unchanged
            on_host = [k for k in saved if k in tier]
            assert on_host
            for k in on_host:
                slot = tier.slot_of(k)
                assert torch.equal(_block(worker.offload_caches, slot), saved[k])
        if (t, c) == (1, 0):  # loaded back for turn 2: the same bytes on the device
            pool = sched.kv.pool
            back = [k for k in saved if pool.get_cached_block(k) is not None]
            assert len(back) == len(saved)
            for k in back:
                assert torch.equal(_block(worker.kv_caches, pool.get_cached_block(k).block_id),
                                   saved[k])

    outs, cached = turns(llm, on_turn)
    assert outs == ref == dev_out
    # Turn two of conversation 0 misses on the device alone; the host tier has all
    # three of its first turn's full blocks (48 tokens).
    assert dev_cached[3] == 0 and cached[3] >= 48
    assert sum(cached) > sum(dev_cached)
    tier.check_invariants()
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    # The requests ran in the steps that loaded their blocks, every layer waiting for
    # its tensor's copies first (worker/block_ops.py).
    ops = worker.runner.block_ops
    assert ops.load_steps > 0 and ops.missed_waits == 0


def test_worker_process_applies_the_tier_copies(reference) -> None:
    """The multiprocess executor (one rank in its own process): the step's offload and
    load lists travel to the worker with the rest of ``SchedulerOutput``."""
    llm = tiny(kv_offload_bytes=32 * BLOCK_BYTES, distributed_executor_backend="mp")
    try:
        outs, cached = turns(llm)
    finally:
        llm.llm_engine.shutdown()
    assert outs == reference and cached[3] >= 48


def test_fp8_kv_cache_with_the_tier_equals_caching_off() -> None:
    kw = {"kv_cache_dtype": "fp8"}
    # fp8: half the bytes of fp32's quarter -- the same budget holds 4x the blocks.
    small = {"kv_cache_memory_bytes": 9 * BLOCK_BYTES // 4}
    ref, _ = turns(LLM(max_model_len=112, max_num_batched_tokens=128, quantization="none",
                       enable_prefix_caching=False, **small, **kw))
    llm = LLM(max_model_len=112, max_num_batched_tokens=128, quantization="none",
              kv_offload_bytes=8 * BLOCK_BYTES, **small, **kw)
    outs, cached = turns(llm)
    assert outs == ref and cached[3] >= 48


@pytest.mark.parametrize("value, match", [
    (-1, "kv_offload_bytes must be"),
    (psutil.virtual_memory().total * 4, "kv_offload_bytes .* exceeds the host's available"),
])
def test_bad_sizes_are_value_errors_naming_the_argument(default_model_path, value,
                                                         match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=default_model_path, kv_offload_bytes=value).create_engine_config()


def test_needs_prefix_caching(default_model_path) -> None:
    with pytest.raises(ValueError, match="kv_offload_bytes: .*enable_prefix_caching"):
        EngineArgs(model=default_model_path, kv_offload_bytes=1 << 20,
                   enable_prefix_caching=False).create_engine_config()


def test_cli_flag_and_vllm_alias_set_bytes() -> None:
    import argparse

    from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

    for flag in ("--kv-offload-size", "--kv-offloading-size"):
        p = argparse.ArgumentParser()
        add_engine_args(p)
        args = p.parse_args(["--model", "m", flag, "0.5"])
        assert engine_args_from_cli(args).kv_offload_bytes == 1 << 29


def test_hybrid_groups_with_the_tier_equal_transformers(model) -> None:  # noqa: F811
    """A tiny Gemma 3 (three sliding groups and one full, sharing one KV tensor; see
    ``test_hybrid_kv_greedy.py``) with a 24-block device pool: after other prompts push
    the first ones out, they come back from the host and still equal transformers."""
    path, ref = model
    llm = _llm(path, 24, 1, kv_offload_bytes=256 * BLOCK_BYTES_HYBRID)
    sched = llm.llm_engine.client.core.scheduler
    assert sched.offload is not None and sched.offload.num_host_blocks == 256
    g = torch.Generator().manual_seed(5)
    others = [torch.randint(0, 300, (60,), generator=g).tolist() for _ in range(4)]
    for prompts in (_prompts(), others, _prompts()):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sched.offload.total_hit_blocks > 0 and sum(o.num_cached_tokens for o in outs) > 0
    ops = llm.llm_engine.client.core.executor.worker.runner.block_ops
    assert ops.load_steps > 0 and ops.missed_waits == 0  # one tensor, four groups' layers
    sched.offload.check_invariants()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
