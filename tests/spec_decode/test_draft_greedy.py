"""Speculative decoding with a draft model (``speculative_config={"model": ...}``):
greedy output is token for token decoding without it on the default SmolLM2 model --
batched, n > 1, a repetition penalty, under preemption and with prefix-cache hits -- for
the default model drafting for itself (every draft the target's own argmax: acceptance
must be ~100%, which checks the draft's KV bookkeeping end to end) and for a tiny random
Llama with the same vocabulary (acceptance ~0: the rollback path).  Afterwards no KV
block is held and the proposer remembers no request that left the runner."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.spec_decode.flat_cost import pin_flat_step_cost
from tests.spec_decode.test_spec_greedy import PROMPTS

PLAIN = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PARAMS = [PLAIN, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                         repetition_penalty=1.2)]


def _tiny_llama(path: str, vocab: int) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def default_vocab() -> int:
    return EngineArgs(quantization="none").create_engine_config().model_config.vocab_size


def _spec_llm(draft: str, kv_mib: int) -> LLM:
    # A KV cache of ~9 blocks (target and draft KV per block): the four sequences do not
    # fit at once (preemption); the shared "Text: ..." prefix gives prefix-cache hits.
    llm = LLM(kv_cache_memory_bytes=kv_mib << 20, max_model_len=128,
              max_num_batched_tokens=256, quantization="none",
              speculative_config={"model": draft, "num_speculative_tokens": 4})
    pin_flat_step_cost(llm, 4)
    return llm


@pytest.fixture(scope="module")
def baseline(llm) -> dict[tuple[int, int], list[list[int]]]:
    """Outputs without speculation, by (prompt, params) index: one generate call for
    both tests (the last prompt also without the penalty)."""
    outs = llm.generate(PROMPTS + PROMPTS[2:], PARAMS + [PLAIN], use_tqdm=False)
    keys = [(0, 0), (1, 1), (2, 2), (2, 0)]
    return {key: [o.token_ids for o in out.outputs] for key, out in zip(keys, outs)}


def _check(baseline, spec_llm, params: list[SamplingParams]) -> tuple[int, int]:
    got = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for i, g in enumerate(got):
        want = baseline[(i, 0 if params[i] is PLAIN else i)]  # PARAMS[i] otherwise
        assert [o.token_ids for o in g.outputs] == want
    core = spec_llm.llm_engine.client.core
    sched = core.scheduler
    assert sched.total_preemptions > 0
    assert any(g.num_cached_tokens > 0 for g in got)
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and not sched.kv.req_to_blocks
    # The proposer's state lives only as long as the runner's row (the runner hears of
    # the last finished request with the next step).
    runner = core.executor.worker.runner
    assert set(runner.spec.draft.computed) <= set(runner.batch.row_of)
    return sched.spec.total_draft_tokens, sched.spec.total_accepted_tokens


def test_default_model_as_its_own_draft_accepts_everything(baseline, default_model_path):
    # No penalty here: the draft proposes its raw argmax, which a penalised target
    # rejects more often (still losslessly: the other test).
    spec_llm = _spec_llm(default_model_path, 14)
    # The memory plan counts the draft's KV in every block: twice the target's here.
    worker = spec_llm.llm_engine.client.core.executor.worker
    target = worker.config.model_config.kv_bytes_per_token()
    assert worker.kv_bytes_per_token() == 2 * target
    drafted, accepted = _check(baseline, spec_llm, PARAMS[:2] + [PLAIN])
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_tiny_random_draft_is_lossless(baseline, tmp_path, default_vocab):
    draft = _tiny_llama(str(tmp_path), default_vocab)
    drafted, _ = _check(baseline, _spec_llm(draft, 7), PARAMS)
    assert drafted > 0


def test_draft_with_another_vocabulary_is_a_value_error(tmp_path):
    draft = _tiny_llama(str(tmp_path), 320)
    with pytest.raises(ValueError, match="speculative_config.*vocab_size 320"):
        EngineArgs(quantization="none", speculative_config={
            "model": draft, "num_speculative_tokens": 4}).create_engine_config()
    from tests.models.tiny_models import build

    sw = tmp_path / "sliding"
    build("mistral_sw", str(sw))  # vocab 320 too: only the window is wrong
    with pytest.raises(ValueError, match="speculative_config.*sliding-window"):
        EngineArgs(model=str(sw), device="cpu", speculative_config={
            "model": draft, "num_speculative_tokens": 4}).create_engine_config()
    with pytest.raises(ValueError, match="speculative_config: model"):
        EngineArgs(speculative_config={"model": str(tmp_path / "missing"),
                                       "num_speculative_tokens": 4}).create_engine_config()
    with pytest.raises(ValueError, match="needs model"):
        EngineArgs(speculative_config={"method": "draft_model",
                                       "num_speculative_tokens": 4}).create_engine_config()
