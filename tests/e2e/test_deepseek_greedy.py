"""DeepSeek-V2/V3 (multi-head latent attention) through the whole engine (``LLM``): greedy
tokens equal transformers' ``generate`` token for token (fp32, CPU) -- batched with a
small token budget (chunked prefill), a latent KV pool small enough that requests are
preempted (recomputed, or swapped to CPU and back), prefix caching on (the prompts
share a 40-token prefix; the second pass is served from cached blocks), n > 1, and beam
search.  The pool is
sized in the MLA cache's bytes per token, which the engine computes
(``ModelConfig.kv_bytes_per_token``)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.engine.arg_utils import EngineArgs
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


# 16 prompts after the shared 40-token prefix (so the fp8 agreement below is a rate).
FP8_TAILS = (5, 23, 12, 30, 3, 17, 9, 26, 14, 1, 21, 7, 33, 11, 19, 28)


def _agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[int, int, int]:
    """(sequences equal, first tokens equal, tokens before each sequence's first
    difference, summed)."""
    prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
              for o, r in zip(outs, ref)]
    return (sum(p == len(r) for p, r in zip(prefix, ref)), sum(p > 0 for p in prefix),
            sum(prefix))


@pytest.mark.parametrize("calculated", [False, True], ids=["scale-1", "calculated-scales"])
def test_fp8_latent_cache_greedy_agreement(calculated: bool, tmp_path) -> None:
    """``kv_cache_dtype="fp8"``: V2-Lite over an e4m3 latent cache (scale 1.0, or
    ``calculate_kv_scales``: amax / 200 of each layer's first-batch entries), batched with
    chunked prefill, a pool small enough to preempt (recompute; with calculated scales,
    swap: fp8 blocks to the CPU and back, ``worker/block_ops.py``) and prefix caching
    (the second pass reads the prompts' cached fp8 blocks).  The cache takes 1 byte an
    element (fp32: 4; bf16: 2), which the engine's figures and the pool's block count
    show.

    Tokens against fp32 transformers (which the fp32 cache matches 16 of 16 here).  fp8
    moves this model's logits by ~0.1-0.25 (``tests/models/test_deepseek.py``), and its
    random weights leave the top two logits within 0.1 of each other at ~30% of greedy
    positions, so sequences diverge: the divergences looked at were at top-2 gaps of
    0.0015-0.065.  Measured on these 16 prompts x 10 tokens (sequences equal, first
    tokens equal, tokens before the first differences): scale 1.0 -- 9, 15, 105 of 160;
    calculated scales -- 12, 15, 140.  Over 8 prompt sets (seeds 7-14): 7-9, 12-16,
    102-120 at scale 1.0 and 7-12, 14-16, 85-140 calculated (e4m3's relative precision is
    the same at either scale: another rounding, another set of near-ties).  Asserted on
    both passes, below every run seen: >= 6 of 16 sequences, >= 12 first tokens, >= 80
    tokens (half) before the first differences."""
    hf = build("v2_lite", str(tmp_path))
    prompts = shared_prefix_prompts(VOCAB, tails=FP8_TAILS)
    ref = hf_greedy(hf, prompts, NEW)
    cfg = hf.config
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    block_bytes = BLOCK * cfg.num_hidden_layers * entry  # one byte an element
    # 24 blocks for 16 requests of 3-5 blocks each: preemption.
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              kv_cache_dtype="fp8", calculate_kv_scales=calculated,
              kv_cache_memory_bytes=24 * block_bytes, max_model_len=128,
              max_num_batched_tokens=32, block_size=BLOCK, enable_prefix_caching=True,
              preemption_mode="swap" if calculated else "recompute", swap_space=0.01)
    core = llm.llm_engine.client.core
    worker, mc = core.executor.worker, llm.llm_engine.config.model_config
    assert worker.kv_bytes_per_token() * BLOCK == block_bytes
    assert mc.kv_bytes_per_token("fp8") * 4 == mc.kv_bytes_per_token("auto")
    assert all(c.dtype == torch.float8_e4m3fn for c in worker.kv_caches)
    assert core.scheduler.kv.pool.num_usable_blocks == 23  # 24 minus the null block
    bf16 = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16",
                      kv_cache_dtype="fp8").create_engine_config().model_config
    assert bf16.kv_bytes_per_token("fp8") * 2 == bf16.kv_bytes_per_token("auto")
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    cached = []
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        equal, first, before = _agreement([o.outputs[0].token_ids for o in outs], ref)
        print(f"fp8 latent cache ({'calculated' if calculated else '1.0'}): {equal}/16 "
              f"sequences, {first}/16 first tokens, {before}/160 before a difference")
        assert equal >= 6 and first >= 12 and before >= 80
        cached.append(sum(o.num_cached_tokens for o in outs))
    assert cached[1] > 0 and core.scheduler.total_preemptions > 0
    if calculated:
        assert core.scheduler.swap.total_swaps > 0
    scales = [m.k_scale for m in worker.model.mla_layers()]
    assert all(s != 1.0 and 0 < s < 0.1 for s in scales) if calculated \
        else scales == [1.0] * len(scales)


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(width: int, tmp_path) -> None:
    """Beam search over the latent cache: the beams share the prompt's blocks and copy the
    partial last block on write (one-entry latent tensors); the beams equal transformers'
    ``generate(num_beams=...)``, best first."""
    hf = build("v2_lite", str(tmp_path))
    prompts = shared_prefix_prompts(VOCAB)[:2]
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              max_model_len=128, block_size=BLOCK)
    ours = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for p, out in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, num_beams=width, num_return_sequences=width,
                              top_p=None, top_k=None, temperature=None)
        assert [s.tokens for s in out.sequences] == ref.tolist()
