"""Greedy tokens equal transformers' ``generate`` token for token (fp32, CPU) for every
architecture of ``tests/models/tiny_models.py``, through the whole engine (``LLM``):
batched with a small token budget (chunked prefill), a KV pool small enough that requests
are preempted and recomputed, and prefix caching on -- the prompts share a 40-token
prefix, and the second pass is served from cached blocks.  For a model whose every layer
slides (``mistral_sw``), the KV manager frees the blocks behind the window meanwhile; for
Gemma's mixed layers, its sliding KV cache group does (the hybrid manager; more in
``tests/e2e/test_hybrid_kv_greedy.py``)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.e2e.hf_greedy import hf_greedy, shared_prefix_prompts
from tests.models.tiny_models import CONFIGS, VOCAB, build

NEW = 10
BLOCK = 16


# Every architecture (RoPE-scaling variants of an architecture are covered by the
# logit tests).
ARCHS = sorted(a for a in CONFIGS if a != "qwen2_yarn")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batched_chunked_preempted_prefix_cached(arch: str, tmp_path) -> None:
    hf = build(arch, str(tmp_path))
    prompts = shared_prefix_prompts(VOCAB)
    ref = hf_greedy(hf, prompts, NEW)
    cfg = hf.config
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = BLOCK * 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4
    # 9 blocks: two ~5-block requests cannot both stay resident -> preemption.
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_bytes=9 * block_bytes, max_model_len=128,
              max_num_batched_tokens=32, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    cached = []
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        cached.append(sum(o.num_cached_tokens for o in outs))
    assert cached[1] > 0
    sched = llm.llm_engine.client.core.scheduler
    assert sched.total_preemptions > 0
    # Every layer slides (Mistral): blocks behind the window were freed as it moved.
    # Sliding and full layers (Gemma): a full and a sliding KV cache group (hybrid).
    managers = getattr(sched.kv, "managers", [sched.kv])
    assert [m.sliding_window for m in managers] == (
        [16] if arch == "mistral_sw" else [None, 16] if arch.startswith("gemma")
        else [None])
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
