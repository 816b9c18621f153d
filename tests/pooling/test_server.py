"""The pooling endpoints of a real ``pagedllm serve`` (one per model kind, started once
per module): ``/v1/embeddings`` through the official ``openai`` client (float and
base64, string / list / token-id inputs, usage) against transformers; ``/score`` and
``/rerank`` (vLLM's and Cohere's shapes) of a cross-encoder against transformers'
sequence-classification logits; the 400s that name the model's task (chat on an
embedding model, embeddings on a cross-encoder; on a generative model:
tests/server/test_pooling_on_generative.py) or the bad field; metrics after it all."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.pooling.tiny_encoders import build_encoder
from tests.server.harness import ServerProcess, running_server

TEXTS = ["the capital of france is paris", "bees make honey from the nectar of flowers",
         "what is the sky", "cats run fast"]
QUERY = "what is the capital city of france"
ARGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, torch.nn.Module]]:
    path = str(tmp_path_factory.mktemp("bert"))
    hf = build_encoder("bert", path)
    hf.tok = transformers.AutoTokenizer.from_pretrained(path)
    with running_server("--model", path, "--served-model-name", "tiny-e5",
                        base_args=ARGS) as s:
        yield s, hf


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, torch.nn.Module]]:
    path = str(tmp_path_factory.mktemp("bert_ce"))
    hf = build_encoder("bert_ce", path)
    hf.tok = transformers.AutoTokenizer.from_pretrained(path)
    with running_server("--model", path, "--served-model-name", "tiny-ce",
                        base_args=ARGS) as s:
        yield s, hf


def _ref_embeddings(hf: torch.nn.Module, tok, texts: list[str]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return F.normalize(torch.stack([hf(**tok(t, return_tensors="pt"))
                                        .last_hidden_state[0, 0] for t in texts]), dim=-1)


def test_startup_log_is_true_for_a_pooling_model(embed_server) -> None:
    """No "KV cache 1 blocks ... max concurrency 0.00x" for a model without a KV cache
    (issue 46 item 20)."""
    log = embed_server[0].log()
    assert "pooling model, no KV cache" in log and "max concurrency" not in log


def test_embeddings_openai_client(embed_server) -> None:
    s, hf = embed_server
    tok = hf.tok
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
    ref = _ref_embeddings(hf, tok, TEXTS)
    # The client asks for base64 by default and decodes it; float on request.
    b64 = client.embeddings.create(model="tiny-e5", input=TEXTS)
    flt = client.embeddings.create(model="tiny-e5", input=TEXTS, encoding_format="float")
    for resp in (b64, flt):
        got = torch.tensor([d.embedding for d in resp.data])
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert float(F.cosine_similarity(got, ref).min()) >= 0.9999
    n = sum(len(tok(t).input_ids) for t in TEXTS)
    assert flt.usage.prompt_tokens == flt.usage.total_tokens == n
    # Two requests may be batched differently (their inputs reach the engine over one or
    # several steps), so their float32 sums can differ in the last bits: equal to 1e-6.
    np.testing.assert_allclose(np.asarray([d.embedding for d in b64.data]),
                               np.asarray([d.embedding for d in flt.data], dtype=np.float32),
                               rtol=0, atol=1e-6)
    # Raw base64 decodes to the same float32 values; one string, token ids, id lists.
    raw = httpx.post(s.url + "/v1/embeddings", json={
        "input": TEXTS[0], "encoding_format": "base64"}, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.dtype == np.float32 and vec.shape == (len(flt.data[0].embedding),)
    np.testing.assert_allclose(vec, np.asarray(flt.data[0].embedding, dtype=np.float32),
                               rtol=0, atol=1e-6)
    ids = [tok(t).input_ids for t in TEXTS[:2]]
    one = client.embeddings.create(model="tiny-e5", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="tiny-e5", input=ids, encoding_format="float")
    # Batch equals alone.
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-6)
    assert np.allclose([d.embedding for d in many.data],
                       [d.embedding for d in flt.data[:2]], atol=1e-6)


def test_embeddings_bad_inputs(embed_server) -> None:
    s, _ = embed_server
    post = lambda path, body: httpx.post(s.url + path, json=body, timeout=60)  # noqa: E731
    for body, param in (({"input": []}, "input"), ({"input": [1.5]}, "input"),
                        ({"input": "the sky", "dimensions": 16}, "dimensions"),
                        ({"input": [7] * 65}, "input"),
                        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "x", "bogus": 1}, "bogus")):
        r = post("/v1/embeddings", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    # Chat on an embedding model: 400 naming the model and its task.
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "tiny-e5" in r.text and "embed" in r.text, r.text
    r = post("/v1/completions", {"prompt": "the sky", "max_tokens": 2})
    assert r.status_code == 400 and "pooling model" in r.text, r.text
    # An embedding model scores by cosine (vLLM): /score still works.
    r = post("/score", {"text_1": TEXTS[0], "text_2": TEXTS[:2]})
    assert r.status_code == 200 and abs(r.json()["data"][0]["score"] - 1.0) < 1e-5, r.text
    # Still serving, and the metrics saw the requests.
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    m = s.metrics()
    done = sum(v for k, v in m.items()
               if k.startswith("vllm:request_success"))
    assert done >= 8, m


def test_inputs_per_request_are_capped_and_gone_clients_stop_work(embed_server) -> None:
    """Issue 46 item 7: more than --max-inputs-per-request (2048) inputs is a 400 naming
    ``input`` and the cap, before any is tokenised; a client that leaves a big request
    (2048 inputs) takes its work with it: a small request right after is served at once."""
    s, _ = embed_server
    url = s.url
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", json={"input": ["cats run"] * 2049}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "2048" in err["message"], err
    for path, body, param in (
            ("/score", {"text_1": "q", "text_2": ["d"] * 2049}, "text_2"),
            ("/rerank", {"query": "q", "documents": ["d"] * 2049}, "documents")):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert time.monotonic() - t0 < 10
    # 2048 inputs of ~50 tokens: about 30 s of work here, far more than the client waits.
    text = " ".join(["bees make honey from the nectar of flowers"] * 6)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/embeddings", json={"input": [text] * 2048}, timeout=1.0)
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 10, time.monotonic() - t0


def test_score_and_rerank_equal_transformers(rerank_server) -> None:
    s, hf = rerank_server
    tok = hf.tok
    enc = tok([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = torch.sigmoid(hf(**enc).logits[:, 0]).tolist()
    for path in ("/score", "/v1/score"):
        r = httpx.post(s.url + path, json={"model": "tiny-ce", "text_1": QUERY,
                                           "text_2": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-6), (got, ref)
    order = sorted(range(len(TEXTS)), key=lambda i: -ref[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(s.url + path, json={
            "model": "tiny-ce", "query": QUERY, "top_n": 2,
            "documents": [TEXTS[0], *({"text": t} for t in TEXTS[1:])]}, timeout=60)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == order[:2]
        assert [x["document"]["text"] for x in res] == [TEXTS[i] for i in order[:2]]
        assert np.allclose([x["relevance_score"] for x in res],
                           [ref[i] for i in order[:2]], rtol=1e-5, atol=1e-6)
    r = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": TEXTS,
                                            "return_documents": False}, timeout=60)
    assert [x["index"] for x in r.json()["results"]] == order
    assert all("document" not in x for x in r.json()["results"])
    for body, param in (({"query": "", "documents": TEXTS}, "query"),
                        ({"query": QUERY, "documents": []}, "documents"),
                        ({"query": QUERY, "documents": TEXTS, "top_n": -1}, "top_n")):
        r = httpx.post(s.url + "/rerank", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(s.url + "/score", json={"text_1": [QUERY, QUERY], "text_2": TEXTS},
                   timeout=60)
    assert r.status_code == 400 and "text_1" in r.text, r.text
    # A cross-encoder does not embed: 400 naming its tasks.
    r = httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 400 and "classify, score" in r.text, r.text
