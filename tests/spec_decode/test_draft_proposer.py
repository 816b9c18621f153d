"""The draft model's KV bookkeeping (worker/spec_decode/draft_model.py), property-tested on a
tiny random Llama: over random rounds of proposals, partial acceptance, bonus tokens,
forgotten requests (preemption) and growing block tables, the drafts are always the
draft model's greedy continuation computed from scratch by transformers, and no draft
KV is written outside the proposing requests' own blocks and scratch blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.spec_decode.draft_model import DraftModelProposer

VOCAB, BS, POOL, MAX_LEN = 96, 4, 48, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_draft"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        architectures=["LlamaForCausalLM"])
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the init: no near-ties in the argmax
        for p in hf.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)
    hf.save_pretrained(path, safe_serialization=True)
    mc = EngineArgs(model=path, device="cpu", max_model_len=MAX_LEN,
                    skip_tokenizer_init=True).create_engine_config().model_config
    return hf, load_model(mc, torch.device("cpu"), TorchReferenceBackend()), mc


def _greedy(hf, tokens: list[int], k: int) -> list[int]:
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens):]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(seed=st.integers(0, 10_000), k=st.integers(1, 5), num_reqs=st.integers(1, 3))
def test_drafts_are_the_greedy_continuation_and_stay_in_own_blocks(tiny, seed, k, num_reqs):
    hf, model, mc = tiny
    rng = random.Random(seed)
    max_rows = 3
    prop = DraftModelProposer(model, k, BS, POOL, max_rows, MAX_LEN, torch.device("cpu"))
    caches = [torch.zeros(2, prop.num_cache_blocks, BS, mc.num_kv_heads, mc.head_dim)
              for _ in range(mc.num_layers)]
    model.bind_kv_caches(caches)
    batch = InputBatch(4, MAX_LEN, BS)
    free = list(range(1, POOL))
    rng.shuffle(free)
    ids = [f"r{i}" for i in range(num_reqs)]
    for rid in ids:
        batch.add(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], [])

    def h2d(name: str, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr))

    for _ in range(4):
        rows, caps = [], []
        for rid in ids:
            row = batch.row_of[rid]
            n = int(batch.num_tokens[row])
            # The scheduler's invariant: the blocks cover the computed tokens (n - 1),
            # and maybe some verify slots beyond.
            want = -(-(n - 1 + rng.randint(0, k)) // BS)
            have = int(batch.num_blocks[row])
            if want > have:
                batch.append_blocks(row, [free.pop() for _ in range(want - have)])
            rows.append(row)
            caps.append(min(rng.randint(0, k + 1), MAX_LEN - n - 1))
            if rng.random() < 0.2:
                prop.forget(rid)  # preempted and resumed: recompute from 0
        owned = {int(b) for r in rows for b in batch.block_table[r, :batch.num_blocks[r]]}
        scratch = set(range(POOL, prop.num_cache_blocks))
        others = sorted(set(range(prop.num_cache_blocks)) - owned - scratch)
        before = [c[:, others].clone() for c in caches]
        drafts = prop.propose(batch, rows, ids, caps, h2d)
        for c, b in zip(caches, before):
            assert torch.equal(c[:, others], b), "draft KV written outside its blocks"
        for row, cap, d in zip(rows, caps, drafts):
            seq = batch.token_ids[row, :batch.num_tokens[row]].tolist()
            assert d == (_greedy(hf, seq, min(cap, k)) if cap > 0 else [])
            # The target accepts a prefix and emits one more token of its own.
            acc = rng.randint(0, len(d))
            new = d[:acc] + [rng.randrange(VOCAB)]
            new = new[:MAX_LEN - 1 - int(batch.num_tokens[row])]
            n0 = int(batch.num_tokens[row])
            batch.token_ids[row, n0:n0 + len(new)] = new
            batch.num_tokens[row] = n0 + len(new)
    for rid in ids:
        prop.forget(rid)
    assert not prop.computed
