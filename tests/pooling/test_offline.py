"""Pooling models through the whole offline engine (``LLM.embed`` / ``score`` /
``classify`` / ``encode``) against transformers on tiny random checkpoints saved as
safetensors with a real WordPiece tokenizer: embeddings at cosine >= 0.9999 (BERT and
XLM-R encoders with CLS / mean pooling, a Qwen3 decoder with last-token pooling through
the scratch KV), cross-encoder scores equal to ``*ForSequenceClassification`` logits,
batch equals alone, whole prompts under a token budget smaller than the batch, and the
bad-input cases (ValueError naming the parameter)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams
from tests.pooling.tiny_encoders import build_encoder, build_qwen3

TEXTS = ["the capital of france is paris", "bees make honey from the nectar of flowers",
         "what is the sky", "cats run fast and dogs run slow, or is it the other way"]
QUERY = "what is the capital city of france"


def _hf_hidden(hf, tok, text: str, xlmr: bool) -> torch.Tensor:
    enc = tok(text, return_tensors="pt")
    if xlmr:
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        return hf(**enc).last_hidden_state[0]


def _cos(got: list[list[float]], ref: torch.Tensor) -> float:
    return float(F.cosine_similarity(torch.tensor(got), ref.float()).min())


@pytest.fixture(scope="module", params=["bert", "xlm_roberta"])
def embedder(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build_encoder(request.param, path)
    # A budget of 40 tokens: the four prompts (10-20 tokens) take several steps.
    llm = LLM(path, device="cpu", max_num_batched_tokens=40, max_num_seqs=8)
    return request.param, hf, llm


def test_embed_matches_transformers_cls(embedder) -> None:
    kind, hf, llm = embedder
    tok = llm.get_tokenizer()
    outs = llm.embed(TEXTS)
    assert [o.prompt_token_ids for o in outs] == [tok(t).input_ids for t in TEXTS]
    ref = F.normalize(torch.stack([_hf_hidden(hf, tok, t, kind != "bert")[0]
                                   for t in TEXTS]), dim=-1)
    assert _cos([o.outputs.embedding for o in outs], ref) >= 0.9999
    # Batch equals alone (and the budget split the batch over steps).
    alone = [llm.embed(t)[0].outputs.embedding for t in TEXTS]
    batch = torch.tensor([o.outputs.embedding for o in outs])
    torch.testing.assert_close(batch, torch.tensor(alone), rtol=1e-5, atol=1e-6)
    # normalize=False: the raw CLS state; encode: the same vector, unnormalised.
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False))[0].outputs.embedding
    enc = llm.encode(TEXTS[0])[0].outputs.data
    torch.testing.assert_close(torch.tensor(raw), _hf_hidden(hf, tok, TEXTS[0],
                                                             kind != "bert")[0],
                               rtol=1e-4, atol=1e-4)
    assert raw == enc


def test_mean_pooling_from_sentence_transformers_config(tmp_path) -> None:
    """A sentence-transformers checkpoint (modules.json, 1_Pooling/config.json with
    mean pooling, a Normalize module) pools as it says."""
    path = str(tmp_path)
    hf = build_encoder("bert", path, seed=5)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type":
                    "sentence_transformers.models.Normalize"}], f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": True}, f)
    llm = LLM(path, device="cpu")
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "mean"
    tok = llm.get_tokenizer()
    ref = F.normalize(torch.stack([_hf_hidden(hf, tok, t, False).mean(0) for t in TEXTS]),
                      dim=-1)
    assert _cos([o.outputs.embedding for o in llm.embed(TEXTS)], ref) >= 0.9999


def test_matryoshka_dimensions(tmp_path) -> None:
    """``dimensions`` keeps the first entries, then normalises -- only on a model whose
    config declares Matryoshka dimensions; elsewhere a ValueError naming it."""
    path = str(tmp_path)
    hf = build_encoder("bert", path, seed=6, matryoshka_dimensions=[16, 32, 64])
    llm = LLM(path, device="cpu")
    tok = llm.get_tokenizer()
    got = llm.embed(TEXTS, PoolingParams(dimensions=16))
    ref = F.normalize(torch.stack([_hf_hidden(hf, tok, t, False)[0, :16] for t in TEXTS]),
                      dim=-1)
    assert all(len(o.outputs.embedding) == 16 for o in got)
    assert _cos([o.outputs.embedding for o in got], ref) >= 0.9999
    with pytest.raises(ValueError, match="^dimensions"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=20))


def test_decoder_last_token_embedding(tmp_path) -> None:
    """A Qwen3 decoder under runner="pooling" (convert embed): last-token pooling,
    normalised, through the runner's scratch KV; two steps' worth of prompts."""
    hf = build_qwen3(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", runner="pooling", max_num_batched_tokens=48)
    mc = llm.llm_engine.config.model_config
    assert (mc.runner, mc.convert, mc.pooler_config.pooling_type) == ("pooling", "embed",
                                                                       "last")
    tok = llm.get_tokenizer()
    with torch.no_grad():
        ref = F.normalize(torch.stack([hf.model(**tok(t, return_tensors="pt"))
                                       .last_hidden_state[0, -1] for t in TEXTS]), dim=-1)
    assert _cos([o.outputs.embedding for o in llm.embed(TEXTS)], ref) >= 0.9999


@pytest.mark.parametrize("kind", ["bert_ce", "xlm_roberta_ce"])
def test_cross_encoder_scores_equal_transformers(kind: str, tmp_path) -> None:
    hf = build_encoder(kind, str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.supported_tasks() == ("classify", "score")
    tok = llm.get_tokenizer()
    enc = tok([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    if kind.startswith("xlm"):
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        logits = hf(**enc).logits[:, 0]
    scores = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    torch.testing.assert_close(torch.tensor(scores), torch.sigmoid(logits), rtol=1e-5,
                               atol=1e-6)
    raw = llm.classify([{"prompt_token_ids": tok(QUERY, t).input_ids,
                         "token_type_ids": tok(QUERY, t).get("token_type_ids")}
                        for t in TEXTS], pooling_params=PoolingParams(use_activation=False))
    torch.testing.assert_close(torch.tensor([o.outputs.probs[0] for o in raw]), logits,
                               rtol=1e-4, atol=1e-5)
    # N x N pairs equal the 1 x N ones.
    pairs = [o.outputs.score for o in llm.score([QUERY] * len(TEXTS), TEXTS)]
    assert pairs == scores


def test_bad_inputs(embedder, tmp_path) -> None:
    _, _, llm = embedder
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("the sky", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^dimensions"):
        llm.embed("the sky", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="^task"):
        llm.classify("the sky")
    with pytest.raises(ValueError, match="^input"):  # 41 tokens > the 40-token budget
        llm.embed({"prompt_token_ids": [7] * 41})
    with pytest.raises(ValueError, match="^dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="^text_1 and text_2"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="^runner"):
        LLM(llm.engine_args.model, device="cpu", runner="generate")
    with pytest.raises(ValueError, match="^pooler_config"):
        LLM(llm.engine_args.model, device="cpu", pooler_config={"pooling_type": "MAX"})
    # The engine still serves after every refusal.
    assert len(llm.embed(TEXTS[0])[0].outputs.embedding) == 64


def test_unsupported_sentence_transformers_mode_is_refused(tmp_path) -> None:
    """A pooling mode we do not implement (max) fails at start-up naming pooler_config
    instead of silently pooling by CLS; pooler_config overrides it."""
    import transformers

    from pagedllm.models.pooling_setup import resolve_runner

    os.makedirs(tmp_path / "1_Pooling")
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode": "max"}))
    cfg = transformers.BertConfig(architectures=["BertModel"])
    with pytest.raises(ValueError, match="^pooler_config: .*'max'"):
        resolve_runner(cfg, str(tmp_path))
    _, _, pc = resolve_runner(cfg, str(tmp_path), pooler_config={"pooling_type": "MEAN"})
    assert pc is not None and (pc.pooling_type, pc.normalize) == ("mean", False)
