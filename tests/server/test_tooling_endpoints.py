"""What evaluation tools need from the server, against the shared real server.

* ``/tokenizer_info`` + ``/tokenize`` + ``/detokenize`` as lm-evaluation-harness's
  ``tokenizer_backend=remote`` uses them (its ``RemoteTokenizer``: special tokens from
  ``/tokenizer_info``, ids via ``/tokenize`` with ``add_special_tokens: false``, the chat
  template rendered client-side with jinja2), checked against the GGUF's own tokenizer
  loaded by transformers.
* ``GET /v1/models/{id}`` through the openai SDK's ``models.retrieve``.
* ``prompt_logprobs`` on ``/v1/completions``, against transformers' forward pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import jinja2
import openai
import pytest
import torch

from tests.server.harness import ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def hf_tokenizer(hf_default_tokenizer):  # type: ignore[no-untyped-def]
    return hf_default_tokenizer


def test_lm_eval_remote_tokenizer_flow(server: ServerProcess, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    base = server.url
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["eos_token"]
    assert info["bos_token"] == hf_tokenizer.bos_token
    assert info["model_max_length"] == 256 and info["tokenizer_class"]

    def encode(text: str) -> list[int]:
        r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    # RemoteTokenizer.eos_token_id is encode(eos_token)[0].
    assert encode(info["eos_token"])[0] == hf_tokenizer.eos_token_id
    assert encode(PROMPT) == hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    ids = encode(PROMPT)
    assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(
        messages=chat, add_generation_prompt=True, bos_token=info["bos_token"],
        eos_token=info["eos_token"])
    assert rendered == hf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                        add_generation_prompt=True)


def test_models_retrieve(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump()["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.fixture(scope="module")
def fp32_server() -> Iterator[ServerProcess]:
    """The default model on its float32 dequantised weights (``--quantization none``):
    what transformers computes too, so logprobs can be compared to 2e-3."""
    with running_server("--quantization", "none") as s:
        yield s


def test_completion_prompt_logprobs_match_transformers(fp32_server: ServerProcess,
                                                       hf_default_model,
                                                       hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(fp32_server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    plp = choice["prompt_logprobs"]
    ids = hf_tokenizer(PROMPT).input_ids
    assert len(plp) == len(ids) and plp[0] is None

    model = hf_default_model
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        tok = ids[pos]
        assert str(tok) in entry
        assert math.isclose(entry[str(tok)]["logprob"], ref[pos - 1, tok].item(),
                            abs_tol=2e-3), pos
        assert entry[str(tok)]["decoded_token"] == hf_tokenizer.decode([tok])
        # The two most likely alternatives, with ranks 1 and 2, are among the entries.
        top2 = torch.topk(ref[pos - 1], 2).indices.tolist()
        ranks = {int(t): e["rank"] for t, e in entry.items()}
        assert {t for t, rk in ranks.items() if rk is not None and rk <= 2} == set(top2)
    # Streamed: vLLM sends them once, in each choice's first chunk (n=2 here).
    with httpx.stream("POST", fp32_server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2,
            "stream": True, "prompt_logprobs": 2}) as sr:
        assert sr.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in sr.iter_lines()
                  if ln.startswith("data: {")]
    seen: dict[int, list] = {}
    for ch in chunks:
        for c in ch["choices"]:
            seen.setdefault(c["index"], []).append(c.get("prompt_logprobs", "absent"))
    assert sorted(seen) == [0, 1]
    for per_chunk in seen.values():
        assert per_chunk[0] == plp  # the same as the non-streamed answer
        assert all(x == "absent" for x in per_chunk[1:])
