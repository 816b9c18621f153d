"""Speculative decoding with EAGLE / EAGLE-3 heads (``speculative_config={"method":
"eagle" | "eagle3", "model": ...}``) end to end: greedy output is token for token
decoding without speculation, batched, under preemption and with prompts run in
chunks (16-token steps), for

* an EAGLE-1 head built to nearly copy a 1-layer target (fc picks the token's embedding,
  the layer is the target's: it computes the target's next-token state shifted by one
  position, missing only the first token of context), so most drafts are accepted and
  the accept/rollback bookkeeping runs on real acceptances;
* a random EAGLE-3 head over a draft vocabulary (d2t) reading 3 aux layers of a 5-layer
  target: drafts are mostly rejected (the rollback path); steps of more than 2 requests
  carry none (``disable_by_batch_size``).

Afterwards no KV block is held."""

from __future__ import annotations

import os
import random

import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from tests.spec_decode.eagle_heads import tiny_target, write_head
from tests.spec_decode.flat_cost import pin_flat_step_cost

VOCAB = 96
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(6, 20))]}
            for _ in range(4)]


def _near_copy_head(path: str, target_path: str) -> None:
    """A 1-layer target whose embeddings have unit RMS (its input norm is then the
    identity, which EAGLE-1 skips) and an EAGLE-1 head fc = [I 0] + the target's layer."""
    hf = tiny_target(target_path, VOCAB, layers=1, scale=2.0)
    with torch.no_grad():
        e = hf.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    hf.save_pretrained(target_path, safe_serialization=True)
    h = hf.config.hidden_size
    t = {k[len("model."):]: v.detach().clone() for k, v in hf.state_dict().items()
         if k.startswith("model.layers.0.")}
    t["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    os.makedirs(path, exist_ok=True)
    hf.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))


def _run(target: str, spec: dict | None, kv_bytes: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=target, device="cpu", skip_tokenizer_init=True, max_model_len=64,
              max_num_batched_tokens=16, kv_cache_memory_bytes=kv_bytes,
              speculative_config=spec)
    if spec is not None:  # drafts are verified whatever the shared CPU timed
        pin_flat_step_cost(llm, spec["num_speculative_tokens"],
                           spec.get("disable_by_batch_size"))
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def _check(target: str, method: str, head: str, **extra: int) -> tuple[int, int]:
    want, _ = _run(target, None, 1 << 20)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3, **extra}
    probe = LLM(model=target, device="cpu", skip_tokenizer_init=True, max_model_len=64,
                kv_cache_memory_bytes=1 << 20, speculative_config=spec)
    per_block = probe.llm_engine.client.core.executor.worker.kv_bytes_per_token() * 16
    # Room for 8 blocks: the 4 sequences (2-3 blocks each) do not fit at once.
    got, llm = _run(target, spec, 8 * per_block)
    assert got == want
    sched = llm.llm_engine.client.core.scheduler
    assert sched.total_preemptions > 0
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and not sched.kv.req_to_blocks
    return sched.spec.total_draft_tokens, sched.spec.total_accepted_tokens


def test_eagle_near_copy_head_is_lossless_and_accepted(tmp_path):
    target, head = str(tmp_path / "target"), str(tmp_path / "head")
    _near_copy_head(head, target)
    drafted, accepted = _check(target, "eagle", head)
    assert drafted > 0 and accepted >= 0.8 * drafted, (drafted, accepted)


def test_eagle3_random_head_is_lossless(tmp_path):
    target, head = str(tmp_path / "target"), str(tmp_path / "head")
    hf = tiny_target(target, VOCAB, layers=5)
    write_head(head, "eagle3", hf.config, draft_vocab=48)
    # Steps with more than 2 requests carry no drafts (the head only reads them).
    drafted, _ = _check(target, "eagle3", head, disable_by_batch_size=2)
    assert drafted > 0
