"""Batch invariance on the default CPU path, bitwise: a greedy request's token ids and
logprobs are the same alone, batched with other requests in mixed prefill + decode
steps (a small ``max_num_batched_tokens`` chunks every prompt), and served from the
prefix cache (issue 46, item 21(b); the streamed half is
``tests/server/test_batch_invariance_server.py``).

Every step of the default model (Q4_1 GGUF, int8 activations) computes each row with
the same per-row arithmetic: the VNNI GEMMs quantise activations per row and reduce K
in a fixed order, RMSNorm and SiLU-mul are per row, and attention runs every row through
one per-row kernel (``attention/cpu_backend.py``).  Equality is exact, so the test
compares with ``==``: no tolerance, nothing that depends on machine speed.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import c1_messages

NEW = 24


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> LLM:
    # 24 tokens per step: C1's 30-50-token prompts take two or three chunks, and those
    # share steps with the other requests' decodes.
    return LLM(kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=24,
               enable_prefix_caching=True)


def _run(engine: LLM, prompts: list[str], cached: bool = False,
         ) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy token ids and their logprobs; ``cached``: every prompt must
    have been served from the prefix cache (all its full 16-token blocks)."""
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, sp, use_tqdm=False)
    if cached:
        assert all(o.num_cached_tokens >= len(o.prompt_token_ids) - 16 for o in outs)
    res = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        res.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs,
                                                                         c.token_ids)]))
    return res


def test_alone_batched_and_cached_are_bitwise_equal(engine: LLM) -> None:
    assert engine.llm_engine.config.model_config.quantization == "gguf"
    tok = engine.get_tokenizer()
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in c1_messages(6)]
    mine = prompts[:3]
    alone = []
    for p in mine:
        engine.reset_prefix_cache()
        alone += _run(engine, [p])
    engine.reset_prefix_cache()
    # Others first, so our requests' prompts are chunked beside their decodes.
    batched = _run(engine, prompts[3:] + mine)[3:]
    cached = _run(engine, mine, cached=True)  # every prompt a prefix-cache hit now
    assert batched == alone
    assert cached == alone
