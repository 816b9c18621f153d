"""DeepSeek-V2/V3 (multi-head latent attention) through the whole engine (``LLM``): greedy
tokens equal transformers' ``generate`` token for token (fp32, CPU) -- batched with a
small token budget (chunked prefill), a latent KV pool small enough that requests are
preempted (recomputed, or swapped to CPU and back), prefix caching on (the prompts
share a 40-token prefix; the second pass is served from cached blocks), and n > 1.  The pool is
sized in the MLA cache's bytes per token, which the engine computes
(``ModelConfig.kv_bytes_per_token``)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.e2e.hf_greedy import hf_greedy, shared_prefix_prompts
from tests.models.deepseek_tiny import VOCAB, build

NEW = 10
BLOCK = 16


@pytest.mark.parametrize("name,preemption", [("v2_lite", "recompute"), ("v3", "recompute"),
                                              ("v2_yarn", "swap")])
def test_greedy_batched_chunked_preempted_prefix_cached(name: str, preemption: str,
                                                        tmp_path) -> None:
    hf = build(name, str(tmp_path))
    prompts = shared_prefix_prompts(VOCAB)
    ref = hf_greedy(hf, prompts, NEW)
    cfg = hf.config
    # One [c_kv | k_pe] entry per token and layer, float32.
    block_bytes = BLOCK * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    # 9 blocks: two ~5-block requests cannot both stay resident -> preemption.
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_memory_bytes=9 * block_bytes, max_model_len=128,
              max_num_batched_tokens=32, block_size=BLOCK, enable_prefix_caching=True,
              preemption_mode=preemption, swap_space=0.01)
    assert llm.llm_engine.config.model_config.kv_bytes_per_token() * BLOCK == block_bytes
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    cached = []
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        cached.append(sum(o.num_cached_tokens for o in outs))
    assert cached[1] > 0
    sched = llm.llm_engine.client.core.scheduler
    assert sched.total_preemptions > 0
    if preemption == "swap":
        assert sched.swap.total_swaps > 0
        # n > 1: the forks share the prompt's blocks; the partial last block is copied on
        # write (block copies over the one-entry latent tensors).
        both = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                        ignore_eos=True, n=2),
                            use_tqdm=False)
        assert [c.token_ids for c in both[0].outputs] == [ref[0], ref[0]]
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_greedy_tensor_and_pipeline_parallel(tp: int, pp: int, tmp_path) -> None:
    """Two CPU ranks (gloo): heads split over TP ranks (each keeps the whole latent
    cache), or layers over PP stages; V3 with its MoE layer."""
    hf = build("v3", str(tmp_path))
    prompts = shared_prefix_prompts(VOCAB)[:2]
    ref = hf_greedy(hf, prompts, NEW)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=128,
              kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        llm.llm_engine.shutdown()
