"""The hybrid KV cache manager end to end: greedy tokens equal transformers' (fp32, CPU)
on a tiny Gemma 3 with three sliding (window 16) layers and one full layer -- four KV
cache groups sharing one KV tensor -- with prompts and outputs longer than the window,
batched and chunked, under recompute and swap preemption, with prefix-cache hits, n > 1
(copy on write in every group) and n-gram speculation (rollback); and the same with
``disable_hybrid_kv_cache_manager``.  (Gemma 2 and 3 with one group of each kind run in
``test_more_archs_greedy.py``.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from tests.models.tiny_models import COMMON, VOCAB, randomize
from tests.spec_decode.flat_cost import pin_flat_step_cost

NEW, BLOCK, WINDOW = 24, 16, 16
KV_HEADS, HEAD_DIM = 2, 16
BLOCK_BYTES = BLOCK * 2 * KV_HEADS * HEAD_DIM * 4  # one layer's KV of a block, fp32


def _config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        **{**COMMON, "tie_word_embeddings": True, "num_hidden_layers": 4},
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        architectures=["Gemma3ForCausalLM"])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    tails = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 25, 13, 30)]
    # The last prompt repeats itself so that n-gram drafts get accepted.
    tails[3] = tails[3][:10] * 3
    return [shared + t for t in tails]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The checkpoint's path and transformers' greedy continuations of ``_prompts``."""
    path = str(tmp_path_factory.mktemp("gemma3_hybrid"))
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(_config()).eval()
    randomize(hf, seed=3)
    hf.save_pretrained(path, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ref = []
    with torch.inference_mode():
        for p in _prompts():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                              top_p=None, top_k=None, temperature=None)
            ref.append(ids[0, len(p):].tolist())
    return path, ref


def _llm(path: str, blocks: int, tensors: int, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32",
               kv_cache_memory_bytes=blocks * tensors * BLOCK_BYTES, max_model_len=128,
               max_num_batched_tokens=32, block_size=BLOCK, enable_prefix_caching=True,
               **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _check_pool_whole(llm: LLM) -> None:
    kv = llm.llm_engine.client.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("hybrid", [True, False])
def test_greedy_preempted_prefix_cached(model, hybrid: bool) -> None:
    path, ref = model
    # Hybrid: 4 groups over 1 tensor; 24 blocks (one request needs up to 6 full + 3 x 4
    # sliding).  Off: 1 group over 4 tensors; 10 blocks (6 per request).  Either way the
    # four requests cannot all stay resident.
    llm = _llm(path, 24, 1, disable_hybrid_kv_cache_manager=not hybrid) if hybrid else \
        _llm(path, 10, 4, disable_hybrid_kv_cache_manager=True)
    cached = []
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        cached.append(sum(o.num_cached_tokens for o in outs))
    sched = llm.llm_engine.client.core.scheduler
    assert cached[1] > 0 and sched.total_preemptions > 0
    managers = getattr(sched.kv, "managers", [sched.kv])
    assert [m.sliding_window for m in managers] == (
        [None, WINDOW, WINDOW, WINDOW] if hybrid else [None])
    _check_pool_whole(llm)


def test_swap_forks_and_speculation_with_hybrid_groups(model) -> None:
    path, ref = model
    swap = _llm(path, 24, 1, preemption_mode="swap", swap_space=0.01)
    outs = swap.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert swap.llm_engine.client.core.scheduler.swap.total_swaps > 0
    _check_pool_whole(swap)
    # n = 2 greedy samples share the prompt's blocks and copy the partial ones on write.
    both = swap.generate(_prompts()[:1], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                        ignore_eos=True, n=2),
                         use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in both] == [[ref[0], ref[0]]]
    _check_pool_whole(swap)
    spec = _llm(path, 24, 1, speculative_config={"method": "ngram",
                                                 "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 3})
    # Rollback is what is tested here: a flat step cost, so that drafts are verified
    # whatever this (shared, noisy) CPU measured at start-up (spec_decode/policy.py).
    pin_flat_step_cost(spec, 3)
    outs = spec.generate(_prompts()[2:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[2:]
    assert spec.llm_engine.client.core.scheduler.spec.total_accepted_tokens > 0
    _check_pool_whole(spec)


@pytest.mark.gpu
def test_cuda_graphs_and_triton_with_hybrid_groups(model) -> None:
    """On the GPU (Triton attention, CUDA graphs: per-group static block tables and slot
    mappings): greedy tokens with the hybrid manager equal those without, and
    transformers' (fp32), with prompts and outputs past the window, under preemption."""
    path, ref = model
    got = {}
    for hybrid in (True, False):
        blocks, tensors = (24, 1) if hybrid else (10, 4)
        llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="float32",
                  kv_cache_memory_bytes=blocks * tensors * BLOCK_BYTES, max_model_len=128,
                  max_num_batched_tokens=32, block_size=BLOCK, enable_prefix_caching=True,
                  disable_hybrid_kv_cache_manager=not hybrid)
        assert llm.llm_engine.client.core.scheduler.kv.num_usable_blocks == blocks - 1
        for _ in range(2):  # the second pass hits the prefix cache
            outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
            got[hybrid] = [o.outputs[0].token_ids for o in outs]
        assert llm.llm_engine.client.core.scheduler.total_preemptions > 0
        _check_pool_whole(llm)
        del llm
    assert got[True] == got[False] == ref
