"""The pooling endpoints on the shared generative server: 400 naming the model's task
(``generate``) and the ``model`` field, and the server keeps serving."""

from __future__ import annotations

import httpx


def test_pooling_endpoints_on_generative_model_are_400(server) -> None:
    for path, body in (("/v1/embeddings", {"input": "hello"}),
                       ("/rerank", {"query": "q", "documents": ["d"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and "its task is generate" in err["message"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
