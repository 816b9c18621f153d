"""Decoder last-token pooling (Qwen3-Embedding style): our Qwen3's final hidden states
through the paged KV cache, pooled at each sequence's last token and normalised, against
transformers' ``Qwen3Model`` run one sequence at a time (cosine >= 0.9999)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.pooler import pool
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession, build_metadata, positions_for
from tests.models.tiny_models import randomize


def test_last_token_pooling_matches_transformers(tmp_path) -> None:
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128,
                                   architectures=["Qwen3ForCausalLM"])
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    randomize(hf, seed=9)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    ec = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32").create_engine_config()
    ours = load_model(ec.model_config, torch.device("cpu"), TorchReferenceBackend())
    mc = ec.model_config
    PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16)  # binds KV
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 21, 12)]
    lens = [len(s) for s in seqs]
    tables, nxt = [], 1
    for n in lens:
        k = -(-n // 16)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    meta = build_metadata([0] * 3, lens, tables, 16)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.inference_mode():
        hidden = ours(ids, positions_for([0] * 3, lens), meta)
        got = pool(hidden, meta.query_start_loc, "last", normalize=True)
        ref = torch.stack([hf.model(torch.tensor([s])).last_hidden_state[0, -1]
                           for s in seqs])
    assert float(F.cosine_similarity(got, F.normalize(ref, dim=-1)).min()) >= 0.9999
