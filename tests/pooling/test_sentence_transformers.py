"""Against sentence-transformers itself, where it is installed (it is not a test
dependency: its wheel pulls in scikit-learn and scipy; ``pip install
sentence-transformers`` runs these): a ``SentenceTransformer`` (BERT, mean pooling,
Normalize) saved by the library loads into our engine with its pooling config and
embeds at cosine >= 0.9999 to ``encode``; a ``CrossEncoder`` scores equal to
``predict`` (sigmoid of the one logit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM
from tests.pooling.tiny_encoders import build_encoder

st = pytest.importorskip("sentence_transformers")
st_modules = pytest.importorskip("sentence_transformers.base.modules")  # 6.x layout
from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: E402

TEXTS = ["the capital of france is paris", "bees make honey from the nectar of flowers",
         "what is the sky", "cats run fast"]


def test_sentence_transformer_embeddings(tmp_path) -> None:
    base = str(tmp_path / "base")
    build_encoder("bert", base, seed=7)
    word = st_modules.Transformer(base)
    model = st.SentenceTransformer(modules=[
        word, Pooling(word.get_embedding_dimension(), "mean"), st_modules.Normalize()],
        device="cpu")
    out = str(tmp_path / "st")
    model.save(out)
    ref = model.encode(TEXTS, convert_to_numpy=True)
    llm = LLM(out, device="cpu")
    pc = llm.llm_engine.config.model_config.pooler_config
    assert (pc.pooling_type, pc.normalize) == ("mean", True)
    got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS)])
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos


def test_cross_encoder_predict(tmp_path) -> None:
    path = str(tmp_path)
    build_encoder("bert_ce", path)
    ce = st.CrossEncoder(path, device="cpu")
    query = "what is the capital city of france"
    ref = ce.predict([(query, t) for t in TEXTS])
    llm = LLM(path, device="cpu")
    got = [o.outputs.score for o in llm.score(query, TEXTS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref, dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)
