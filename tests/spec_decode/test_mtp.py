"""DeepSeek-V3's MTP layer as a proposer (``speculative_config={"method": "mtp"}``,
``models/deepseek_mtp.py``, ``worker/spec_decode/mtp.py``), on tiny random V3
checkpoints with an MTP layer added (``tests/spec_decode/mtp_tiny.py``), fp32 on CPU:

* the layer's forward over a paged latent cache (two requests: a batched prefill, then
  batched one-token steps) equals a torch reference written from the formula, with
  transformers' ``DeepseekV3DecoderLayer`` as the decoder layer -- MoE and dense, own and
  shared embedding / LM head;
* greedy output with MTP speculation (k = 1, 2) is token for token the output without,
  batched (prompt chunks, preemption) and single, with drafts proposed and verified; a
  near-copy MTP layer gets most of its drafts accepted (so the layer reads the hidden
  state and token of the right positions), a random one mostly rejected (rollbacks);
* dummy weights work; a target without an MTP layer, or not DeepSeek-V3, is a
  ValueError naming ``speculative_config``."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.worker.spec_decode.mtp import load_mtp
from tests.spec_decode.eagle_heads import tiny_target
from tests.spec_decode.flat_cost import pin_flat_step_cost
from tests.spec_decode.mtp_tiny import VOCAB, write_near_copy, write_random

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
BS = 4


def _config(path: str, k: int = 1, **kw: object):
    return EngineArgs(model=path, device="cpu", max_model_len=64, skip_tokenizer_init=True,
                      speculative_config={"method": "mtp", "num_speculative_tokens": k},
                      **kw).create_engine_config()  # type: ignore[arg-type]


# -- the layer against the formula ------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _reference(hf, n: int, extra: dict[str, torch.Tensor], ids: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, logits)`` of MTP layer ``n`` at positions 0..T-1 of one sequence, entry p
    reading ``ids[p]`` (the token at p + 1) and ``hidden[p]``: x = eh_proj(cat(enorm(e),
    hnorm(h))) with e zeroed at position 0, transformers' decoder layer (full causal
    attention) at position p, logits = head(shared_head.norm(g))."""
    p = f"model.layers.{n}."
    emb = extra.get(p + "embed_tokens.weight", hf.model.embed_tokens.weight)
    head = extra.get(p + "shared_head.head.weight", hf.lm_head.weight)
    t = len(ids)
    pos = torch.arange(t)
    with torch.no_grad():
        e = emb[ids].clone()
        e[pos == 0] = 0.0
        x = torch.cat([_rms(e, extra[p + "enorm.weight"]),
                       _rms(hidden, extra[p + "hnorm.weight"])], -1) @ extra[
            p + "eh_proj.weight"].T
        cos_sin = DeepseekV3RotaryEmbedding(hf.config)(x[None], pos[None])
        mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                             float("-inf"))[None, None]
        g = hf.model.layers[n](x[None], attention_mask=mask, position_ids=pos[None],
                               position_embeddings=cos_sin)[0]
        return g, _rms(g, extra[p + "shared_head.norm.weight"]) @ head.T


def _meta(qlens: list[int], seq_lens: list[int], tables: np.ndarray,
          slots: np.ndarray) -> AttentionMetadata:
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(qlens), max_query_len=max(qlens),
        max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=seq,
        block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
        query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq.clone(), block_size=BS)


@pytest.mark.parametrize("first_dense,own", [(1, True), (5, False)], ids=["moe", "dense"])
def test_mtp_layer_equals_the_formula(tmp_path, first_dense, own):
    path = str(tmp_path)
    hf, extra = write_random(path, layers=2, first_dense=first_dense, seed=first_dense,
                             own_embed=own, own_head=own)
    config = _config(path)
    dc = config.scheduler_config.speculative_config.draft_model_config
    assert dc.num_layers == 1 and dc.head_dim == 32 + 8  # one latent entry per token
    cpu = torch.device("cpu")
    target = load_model(config.model_config, cpu, TorchReferenceBackend())
    mtp = load_mtp(dc, target, cpu)
    assert (mtp.embed_tokens is not None) == own and (mtp.shared_head.head is not None) == own
    cache = torch.zeros(1, 16, BS, 1, dc.head_dim)
    mtp.bind_kv_caches([cache])

    g = torch.Generator().manual_seed(7)
    lens = [9, 6]  # two requests: prefill 6 / 3 tokens together, then 3 one-token steps
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    hidden = [torch.randn(n, 64, generator=g) for n in lens]
    tables = np.asarray([[3, 9, 1, 0, 0], [12, 5, 0, 0, 0]], dtype=np.int32)
    got_g: list[list[torch.Tensor]] = [[], []]
    got_l: list[list[torch.Tensor]] = [[], []]
    start = [0, 0]
    for step in range(4):
        q = [n - 3 for n in lens] if step == 0 else [1, 1]
        pos = [np.arange(s, s + k) for s, k in zip(start, q)]
        slots = np.concatenate([tables[i, p // BS].astype(np.int64) * BS + p % BS
                                for i, p in enumerate(pos)])
        meta = _meta(q, [s + k for s, k in zip(start, q)], tables, slots)
        flat_pos = torch.from_numpy(np.concatenate(pos))
        with torch.inference_mode():
            out, nxt = mtp(torch.cat([ids[i][p] for i, p in enumerate(pos)]), flat_pos,
                           torch.cat([hidden[i][p] for i, p in enumerate(pos)]), meta)
            logits = mtp.compute_logits(out)
        assert out is nxt
        off = 0
        for i, k in enumerate(q):
            got_g[i].append(out[off:off + k])
            got_l[i].append(logits[off:off + k])
            off += k
            start[i] += k
    for i in range(2):
        want_g, want_l = _reference(hf, 2, extra, ids[i], hidden[i])
        torch.testing.assert_close(torch.cat(got_g[i]), want_g, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(got_l[i]), want_l, rtol=1e-4, atol=1e-4)
        assert torch.equal(torch.cat(got_l[i]).argmax(-1),
                           mtp.draft_tokens(torch.cat(got_g[i])))


# -- end to end: lossless ---------------------------------------------------------------
def _prompts(n: int = 4) -> list[dict[str, list[int]]]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(6, 20))]}
            for _ in range(n)]


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """The engines below run one torch thread (``num_threads=1`` sets it process-wide);
    the rest of the session gets its count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _generate(path: str, spec: dict | None, prompts: list, kv_bytes: int = 1 << 20,
              **kw: object) -> tuple[list[list[int]], LLM]:
    # One thread: tiny matrices, and a second thread only waits on a busy shared CPU.
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, max_model_len=64,
              max_num_batched_tokens=16, kv_cache_memory_bytes=kv_bytes,
              speculative_config=spec, num_threads=1, **kw)
    if spec is not None:  # drafts are verified whatever the shared CPU timed
        pin_flat_step_cost(llm, spec["num_speculative_tokens"])
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def _kv_bytes_per_block(path: str, k: int, **kw: object) -> int:
    """A KV block's bytes with the MTP layer's latent cache (the target's + the layer's)."""
    config = _config(path, k, **kw)
    draft = config.scheduler_config.speculative_config.draft_model_config
    return 16 * (config.model_config.kv_bytes_per_token() + draft.kv_bytes_per_token())


def _check(path: str, k: int, prompts: list, want: list[list[int]] | None = None,
           small_kv: bool = False, **kw: object) -> tuple[list[list[int]], int, int]:
    """Generate with ``k`` MTP drafts; unless ``want`` is None, the output must equal it
    (greedy output without speculation).  With ``small_kv``: room for 8 blocks, which
    the 4 sequences (2-3 blocks each) do not fit at once (preemption).  Afterwards no
    block is held.  Returns (the output, drafts verified, drafts accepted)."""
    spec = {"method": "mtp", "num_speculative_tokens": k}
    kv_bytes = 8 * _kv_bytes_per_block(path, k, **kw) if small_kv else 1 << 20
    got, llm = _generate(path, spec, prompts, kv_bytes, **kw)
    if want is not None:
        assert got == want
    sched = llm.llm_engine.client.core.scheduler
    if small_kv:
        assert sched.total_preemptions > 0
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and not sched.kv.req_to_blocks
    return got, sched.spec.total_draft_tokens, sched.spec.total_accepted_tokens


@pytest.fixture(scope="module")
def near_copy(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The near-copy checkpoint and its greedy output for ``_prompts()`` without
    speculation."""
    path = str(tmp_path_factory.mktemp("mtp_near_copy"))
    write_near_copy(path)
    return path, _generate(path, None, _prompts())[0]


@pytest.mark.parametrize("k,small_kv", [(1, False), (2, True)])
def test_mtp_near_copy_is_lossless_and_accepted(near_copy, k, small_kv):
    path, want = near_copy
    _, drafted, accepted = _check(path, k, _prompts(), want, small_kv)
    assert drafted > 0 and accepted >= 0.8 * drafted, (drafted, accepted)


def test_mtp_single_request_is_lossless(near_copy):
    path, _ = near_copy
    prompt = _prompts(1)
    _, drafted, accepted = _check(path, 2, prompt, _generate(path, None, prompt)[0])
    assert drafted > 0 and accepted > 0


def test_mtp_random_layer_is_lossless(tmp_path):
    """A random MoE MTP layer with its own LM head: drafts mostly rejected."""
    path = str(tmp_path)
    write_random(path, layers=2, first_dense=1, own_head=True)
    prompts = _prompts(3)
    _, drafted, _ = _check(path, 2, prompts, _generate(path, None, prompts)[0])
    assert drafted > 0


def test_mtp_dummy_weights(tmp_path):
    """Dummy weights (``load_format="dummy"``: nearly flat logits, so no output to
    compare): the layer is built, drafts and verifies, and frees every block."""
    path = str(tmp_path)
    write_random(path, layers=2, first_dense=1)
    got, drafted, _ = _check(path, 2, _prompts(2), load_format="dummy")
    assert drafted > 0 and [len(t) for t in got] == [PARAMS.max_tokens] * 2


# -- configuration ----------------------------------------------------------------------
def test_deepseek_mtp_is_an_alias_and_takes_no_model():
    spec = SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert spec is not None and spec.method == "mtp"
    with pytest.raises(ValueError, match="speculative_config: model is not used"):
        SpeculativeConfig.from_dict({"method": "mtp", "model": "x",
                                     "num_speculative_tokens": 1})


def test_mtp_on_a_llama_target_is_refused(tmp_path):
    tiny_target(str(tmp_path), 96, layers=1)
    with pytest.raises(ValueError, match="speculative_config.*DeepSeek-V3"):
        _config(str(tmp_path))


def test_mtp_without_an_mtp_layer_is_refused(tmp_path):
    path = str(tmp_path)
    write_random(path)
    # The tensors are there, the config says none.
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 0}, f)
    with pytest.raises(ValueError, match="speculative_config.*num_nextn_predict_layers=0"):
        _config(path)
    # The config says one, the checkpoint has none (transformers writes none).
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "num_hidden_layers": 3}, f)
    with pytest.raises(ValueError, match="speculative_config.*model.layers.3.enorm"):
        _config(path)
