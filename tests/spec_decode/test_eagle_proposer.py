"""EAGLE and EAGLE-3 heads (worker/spec_decode/eagle.py, eagle_proposer.py) against a plain torch
reference of their math (tests/spec_decode/eagle_heads.py): over rounds of a batched
target step (prefill, then verify steps with partial acceptance and a bonus token) the
proposer's drafts are always the head's greedy chain computed from scratch, so the head
is computed right and its paged KV (rewritten speculative positions, scratch blocks,
growing block tables) is bookkept right; no head KV lands outside the proposing
requests' blocks.  Also: a head that does not fit is a ValueError naming
``speculative_config``."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_model
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.spec_decode.eagle import enable_aux_states, load_eagle_head
from pagedllm.worker.spec_decode.eagle_proposer import EagleProposer, TargetStates
from tests.spec_decode.eagle_heads import reference_drafts, tiny_target, write_head

VOCAB, BS, POOL, MAX_LEN, K = 96, 4, 64, 96, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eagle_target"))
    return path, tiny_target(path, VOCAB, layers=5)


def _engine_config(target_path: str, head: str, method: str):
    return EngineArgs(model=target_path, device="cpu", max_model_len=MAX_LEN,
                      skip_tokenizer_init=True, speculative_config={
                          "method": method, "model": head,
                          "num_speculative_tokens": K}).create_engine_config()


def _h2d(name: str, arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr))


@pytest.mark.parametrize("method,draft_vocab,backend_name", [
    ("eagle", None, "torch"), ("eagle3", 40, "torch"), ("eagle3", 40, "triton")])
def test_drafts_equal_the_reference_over_verify_rounds(target, tmp_path, method, draft_vocab,
                                                       backend_name):
    """``triton``: the GPU attention backend (interpreted on CPU, so 2 rounds; rotary
    fused into its KV write), for the target and the head."""
    target_path, hf = target
    # The EAGLE-1 head as the published ones are stored: pytorch_model.bin.
    w = write_head(str(tmp_path / method), method, hf.config, draft_vocab=draft_vocab,
                   fmt="bin" if method == "eagle" else "safetensors")
    config = _engine_config(target_path, str(tmp_path / method), method)
    mc, dc = config.model_config, config.scheduler_config.speculative_config.draft_model_config
    cpu, backend = torch.device("cpu"), TorchReferenceBackend()
    if backend_name == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    model = load_model(mc, cpu, backend)
    head = load_eagle_head(dc, method, model, cpu, backend)
    if method == "eagle3":
        enable_aux_states(model, dc.hf_config, 256)
    prop = EagleProposer(head, K, BS, POOL, 3, MAX_LEN, cpu)
    t_caches = [torch.zeros(2, prop.num_cache_blocks, BS, mc.num_kv_heads, mc.head_dim)
                for _ in range(mc.num_layers)]
    model.bind_kv_caches(t_caches)
    h_caches = [torch.zeros(2, prop.num_cache_blocks, BS, dc.num_kv_heads, dc.head_dim)]
    head.bind_kv_caches(h_caches)

    rng = random.Random(0)
    batch = InputBatch(4, MAX_LEN, BS)
    free = list(range(1, POOL))
    rng.shuffle(free)
    ids = ["a", "b", "c"]
    for rid in ids:
        batch.add(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(2, 11))], [])
    rows = [batch.row_of[r] for r in ids]
    drafts: list[list[int]] = [[] for _ in ids]

    def target_step(req_idx: list[int], ends: list[int]) -> TargetStates:
        """The target runs requests ``req_idx`` from ``p0`` up to ``ends`` (their
        drafts after their known tokens), batched."""
        qs, poss, reqs = [], [], []
        for i, end in zip(req_idx, ends):
            row = rows[i]
            n = int(batch.num_tokens[row])
            toks = (batch.token_ids[row, p0[i]:n].tolist() + drafts[i])[:end - p0[i]]
            want = -(-(p0[i] + len(toks)) // BS)
            have = int(batch.num_blocks[row])
            batch.append_blocks(row, [free.pop() for _ in range(want - have)])
            qs.append(toks)
            poss.append(np.arange(p0[i], p0[i] + len(toks)))
            reqs.append(np.full(len(toks), len(reqs)))
        tbl = prop.block_tables(batch.block_table, batch.num_blocks,
                                np.asarray([rows[i] for i in req_idx]))
        q = np.asarray([len(t) for t in qs])
        qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        pos, req = np.concatenate(poss), np.concatenate(reqs)
        starts = np.asarray([p0[i] for i in req_idx])
        meta = prop._meta(_h2d, "t", qsl, (starts + q).astype(np.int32), tbl,
                          prop._slots(tbl, req, pos))
        hidden = model(torch.tensor(sum(qs, [])), torch.from_numpy(pos), meta)
        states = hidden if method == "eagle" else model.model.aux_buffer[:len(pos)]
        return TargetStates(states, {ids[i]: (int(qsl[j]), p0[i], int(q[j]))
                                     for j, i in enumerate(req_idx)})

    # Request "a"'s prompt arrives in two chunks: the head observes the first one.
    p0 = [0, 0, 0]  # where each request's next target step starts
    chunk = int(batch.num_tokens[rows[0]]) // 2
    prop.observe(batch, [rows[0]], ["a"], _h2d, target_step([0], [chunk]))
    p0[0] = chunk
    for _round in range(4 if backend_name == "torch" else 2):
        step = target_step([0, 1, 2], [MAX_LEN] * 3)
        # Verification: a random prefix of the drafts, then a token of the target's own.
        for i, row in enumerate(rows):
            acc = rng.randint(0, len(drafts[i]))
            new = drafts[i][:acc] + [rng.randrange(VOCAB)]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n:n + len(new)] = new
            batch.num_tokens[row] = n + len(new)
            p0[i] = n + len(new) - 1  # the next step starts at the last known token
        owned = {int(b) for r in rows for b in batch.block_table[r, :batch.num_blocks[r]]}
        others = sorted(set(range(POOL)) - owned)
        before = h_caches[0][:, others].clone()
        caps = [K, rng.randint(1, K), K]
        drafts = prop.propose(batch, rows, ids, caps, _h2d, step)
        assert torch.equal(h_caches[0][:, others], before), "head KV outside its blocks"
        for i, row in enumerate(rows):
            seq = batch.token_ids[row, :batch.num_tokens[row]].tolist()
            assert drafts[i] == reference_drafts(method, w, hf, seq, caps[i]), (_round, i)


def test_a_head_that_does_not_fit_is_a_value_error(target, tmp_path):
    target_path, hf = target
    bad = str(tmp_path / "bad3")
    write_head(bad, "eagle3", hf.config, fc_in=2 * hf.config.hidden_size)
    with pytest.raises(ValueError, match=r"speculative_config: .*fc\.weight of shape"):
        _engine_config(target_path, bad, "eagle3")
    bad1 = str(tmp_path / "bad1")
    write_head(bad1, "eagle", hf.config, fc_in=3 * hf.config.hidden_size)
    with pytest.raises(ValueError, match=r"speculative_config: .*fc\.weight of shape"):
        _engine_config(target_path, bad1, "eagle")
    empty = tmp_path / "empty"
    empty.mkdir()
    hf.config.save_pretrained(str(empty))
    with pytest.raises(ValueError, match="speculative_config: .* no .*safetensors or "):
        _engine_config(target_path, str(empty), "eagle")
    for method in ("eagle", "eagle3"):
        with pytest.raises(ValueError, match="speculative_config: method .* needs model"):
            EngineArgs(model=target_path, device="cpu", speculative_config={
                "method": method, "num_speculative_tokens": 2}).create_engine_config()
        with pytest.raises(ValueError, match="speculative_config: model"):
            _engine_config(target_path, str(tmp_path / "missing"), method)


@pytest.mark.parametrize("method,shape,fc_in", [("eagle", "eagle-llama3-8b", 8192),
                                                ("eagle3", "eagle3-llama3-8b", 3 * 4096)])
def test_benchmark_dummy_heads_fit_the_dummy_target(method, shape, fc_in, tmp_path):
    """`pagedllm bench latency --dummy llama3-8b --draft-dummy <head>` shapes: accepted by
    the config checks, and built (on the meta device) as the published heads are."""
    from pagedllm.benchmarks.workloads import write_dummy_model
    from pagedllm.worker.spec_decode.eagle import EagleHead

    (tmp_path / "t").mkdir()
    (tmp_path / "h").mkdir()
    config = EngineArgs(
        model=write_dummy_model("llama3-8b", str(tmp_path / "t")), load_format="dummy",
        skip_tokenizer_init=True, device="cpu", max_model_len=256, speculative_config={
            "method": method, "model": write_dummy_model(shape, str(tmp_path / "h")),
            "num_speculative_tokens": 4}).create_engine_config()
    dc = config.scheduler_config.speculative_config.draft_model_config
    with torch.device("meta"):
        target = LlamaForCausalLM(config.model_config.hf_config, TorchReferenceBackend())
        head = EagleHead(dc.hf_config, TorchReferenceBackend(), target, method)
    assert tuple(head.fc.weight.shape) == (4096, fc_in)
    assert dc.kv_bytes_per_token() == 2 * 8 * 128 * dc.dtype_bytes  # one layer
