"""The BERT / XLM-RoBERTa encoders and poolers against transformers on tiny random
checkpoints (saved as safetensors): per-token hidden states close, pooled embeddings
(CLS, mean, last; normalised) at cosine >= 0.9999 -- three sequences of different
lengths in one flattened batch against HF run one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedllm.models.bert import BertModel, XLMRobertaModel
from pagedllm.models.loader import iter_safetensors
from tests.models.tiny_models import randomize

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=128)
CASES = {
    "bert": (transformers.BertConfig, transformers.BertModel, BertModel, {}),
    "xlm_roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                    XLMRobertaModel, {"pad_token_id": 1}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cfg_cls, hf_cls, ours_cls, extra = CASES[request.param]
    cfg = cfg_cls(**TINY, **extra)
    hf = hf_cls(cfg).eval()
    randomize(hf, seed=3)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path, safe_serialization=True)
    ours = ours_cls(cfg).eval()
    ours.load_weights(iter_safetensors(path))
    return ours, hf


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 320, (n,), generator=g).tolist() for n in (9, 30, 17)]


@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_encoder_matches_transformers(pair, pooling: str) -> None:
    ours, hf = pair
    seqs = _seqs()
    ids = torch.tensor([t for s in seqs for t in s])
    qsl = torch.tensor([0, 9, 39, 56], dtype=torch.int32)
    with torch.inference_mode():
        hidden = ours(ids, qsl)
        got = ours.embed(ids, qsl, pooling, normalize=True)
        refs = [hf(torch.tensor([s])).last_hidden_state[0] for s in seqs]
    torch.testing.assert_close(hidden, torch.cat(refs), atol=1e-4, rtol=0)
    pick = {"cls": lambda h: h[0], "mean": lambda h: h.mean(0), "last": lambda h: h[-1]}
    ref = F.normalize(torch.stack([pick[pooling](h) for h in refs]), dim=-1)
    assert float(F.cosine_similarity(got, ref).min()) >= 0.9999
