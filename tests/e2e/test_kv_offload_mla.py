"""The prefix cache's host and disk tiers with multi-head latent attention (a tiny random
DeepSeek-V2-Lite, CPU, fp32): each block's latent entries (``[c_kv | k_pe]``, one
"head") leave the device and come back like GQA's keys and values.  With a device pool
too small for three conversations, greedy outputs with the tiers on equal prefix caching
off token for token, and later turns hit on the host (and, with a two-block host pool,
on disk) where the device alone misses."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.models import deepseek_tiny

NEW = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("v2_lite"))
    deepseek_tiny.build("v2_lite", p)
    return p


def _block_bytes(path: str) -> int:
    cfg = EngineArgs(model=path, device="cpu", skip_tokenizer_init=True).create_engine_config()
    return cfg.model_config.kv_bytes_per_token("auto") * cfg.cache_config.block_size


def _llm(path: str, **kw) -> LLM:
    # 8 usable blocks (128 tokens): one conversation's second turn holds 4.
    return LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32",
               kv_cache_memory_bytes=9 * _block_bytes(path), max_model_len=112,
               max_num_batched_tokens=128, **kw)


def _turns(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Three conversations, two turns each, round-robin, one request at a time."""
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    vocab = deepseek_tiny.VOCAB
    prompts = [[(7 + 37 * c + 11 * i) % vocab for i in range(48)] for c in range(3)]
    outs, cached = [], []
    try:
        for _ in range(2):
            for c in range(3):
                o = llm.generate([{"prompt_token_ids": prompts[c]}], sp, use_tqdm=False)[0]
                toks = list(o.outputs[0].token_ids)
                outs.append(toks)
                cached.append(o.num_cached_tokens)
                prompts[c] = prompts[c] + toks + [(200 + 5 * c + i) % vocab
                                                  for i in range(12)]
        # Every forward that read host-tier loads had each latent layer wait for them.
        assert llm.llm_engine.client.core.executor.worker.runner.block_ops.missed_waits == 0
    finally:
        llm.llm_engine.shutdown()
    return outs, cached


def test_mla_blocks_through_host_and_disk_tiers_equal_caching_off(path) -> None:
    ref, _ = _turns(_llm(path, enable_prefix_caching=False))
    dev_out, dev_cached = _turns(_llm(path))
    block = _block_bytes(path)
    host_out, host_cached = _turns(_llm(path, kv_offload_bytes=32 * block))
    assert host_out == ref == dev_out
    # Conversation 0's second turn misses on the device alone; the host has its first
    # turn's three full blocks (48 tokens).
    assert dev_cached[3] == 0 and host_cached[3] >= 48
    # Two host slots: conversation 0's blocks go on to disk and come back through them.
    disk_out, disk_cached = _turns(_llm(path, kv_offload_bytes=2 * block,
                                        kv_offload_disk_bytes=32 * block))
    assert disk_out == ref and disk_cached[3] >= 48
