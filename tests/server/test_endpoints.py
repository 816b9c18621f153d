"""Every endpoint of the server, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.harness import ServerProcess

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_health_version(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    with server.client() as c:
        assert c.get("/health").status_code == 200
        v = c.get("/version")
        assert v.status_code == 200 and v.json()["version"]


def test_completion_text_prompt(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.strip()
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_prompt_forms(server: ServerProcess, client: openai.OpenAI,
                                 model: str) -> None:
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                        temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"],
                                     max_tokens=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    lists = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=2,
                                      temperature=0)
    assert len(lists.choices) == 2
    assert lists.usage.prompt_tokens == len(ids) + 3


def test_completion_echo_and_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text.startswith(PROMPT)
    lp = ch.logprobs
    assert lp is not None
    # Echo + logprobs: prompt tokens (the first has no logprob) then the 3 new tokens.
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert all(v is None or v <= 0 for v in lp.token_logprobs)
    gen_top = lp.top_logprobs[-1]
    assert gen_top and 1 <= len(gen_top) <= 3
    # Greedy: the chosen token is the most likely one.
    assert lp.token_logprobs[-1] == pytest.approx(max(gen_top.values()), abs=1e-4)


def test_completion_n2_and_seed(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=2,
                                  temperature=1.0, seed=1234)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 10
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=2,
                                      temperature=1.0, seed=1234)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_completion_stop(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8,
                                     temperature=0).choices[0].text
    assert "," in full, full
    stop = full[: full.index(",") + 1].strip()[-1]  # a character the model will emit
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8,
                                  temperature=0, stop=[stop])
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and stop not in ch.text
    assert full.startswith(ch.text)
    kept = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                     temperature=0)
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_sse_framing(server: ServerProcess, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT,  # type: ignore[arg-type]
                                       max_completion_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=10, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not chunks[0].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_n2_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT,  # type: ignore[arg-type]
                                       max_tokens=4, temperature=0, n=2, logprobs=True,
                                       top_logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for ch in r.choices:
        content = ch.logprobs.content
        assert len(content) == 4
        for tok in content:
            assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
            # Greedy: the chosen token is the top one.
            assert tok.top_logprobs[0].token == tok.token
    # Greedy samples are identical.
    assert r.choices[0].message.content == r.choices[1].message.content


def test_chat_stream_n2_role_first(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0, n=2, stream=True))  # type: ignore[arg-type]
    seen_role: set[int] = set()
    for c in chunks:
        for ch in c.choices:
            if ch.delta.role:
                seen_role.add(ch.index)
            elif ch.delta.content:
                assert ch.index in seen_role, "content before the role"
    assert seen_role == {0, 1}


def test_completion_return_token_ids(server: ServerProcess, model: str) -> None:
    """vLLM's ``return_token_ids``: the choice carries its token ids (streamed: each
    chunk its new ones, the first chunk the prompt's), consistent with the text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    with server.client() as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]
        tok = c.post("/tokenize", json={"model": model, "prompt": PROMPT}).json()["tokens"]
        detok = c.post("/detokenize", json={"model": model,
                                            "tokens": full["token_ids"]}).json()["prompt"]
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(full["token_ids"]) == 6 and detok == full["text"]
    assert full["prompt_token_ids"] == tok
    streamed = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    assert streamed == full["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok
    assert all("prompt_token_ids" not in ch["choices"][0] for ch in chunks[1:])


def test_vllm_extras_accepted(client: openai.OpenAI, model: str) -> None:
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
              "ignore_eos": True, "stop_token_ids": [2], "include_stop_str_in_output": False,
              "skip_special_tokens": True, "priority": 0}
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, seed=7,
                                  temperature=0.8, extra_body=extras)
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3,  # type: ignore[arg-type]
                                       seed=7, extra_body=extras)
    assert r.usage.completion_tokens == 3


def test_ignored_openai_fields(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                       user="someone", store=False, metadata={"a": "b"},
                                       service_tier="auto", parallel_tool_calls=False)
    assert r.usage.completion_tokens == 2


def test_tokenize_detokenize(server: ServerProcess) -> None:
    with server.client() as c:
        t = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 256
        d = c.post("/detokenize", json={"tokens": t["tokens"]}).json()
        assert "Hello world" in d["prompt"]
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["count"] > t["count"]


def test_metrics_names(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total",
                 'request_success_total{finished_reason="length"}',
                 "num_preemptions_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert f"vllm:{name}" in m, name
    assert m["vllm:generation_tokens_total"] >= 2
    assert m['vllm:request_success_total{finished_reason="length"}'] >= 1
    text = httpx.get(server.url + "/metrics").text
    assert 'model_name="SmolLM2-135M-Instruct"' in text


def test_streamed_unicode_deltas_are_whole_characters(client: openai.OpenAI,
                                                      model: str) -> None:
    prompt = "Translate to Japanese and add an emoji 👍🏽: good morning →"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                     temperature=0).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices]
    assert "".join(deltas) == full
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # every delta is valid UTF-8 on its own
