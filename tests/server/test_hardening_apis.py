"""Issue 46 (the 500s, and API gaps): each input was a 5xx (or a refusal of a valid
request) before its fix; now each bad one is a 400 naming the field, and the server
still answers afterwards.

* item 8: ``tool_choice`` of the wrong shape (``"function"`` a string or a list, a
  Responses-only type) on chat, Responses and Messages;
* item 9: tool-call ``arguments`` (and whole bodies) nested 100,000 deep;
* item 10: ``NaN``/``Infinity`` anywhere in any body (Responses stored the response and
  every later ``GET`` was a 500);
* item 11: a tool call whose arguments are no JSON object, on ``/v1/messages``;
* item 14: ``echo`` with ``max_tokens: 0`` (prompt scoring) is accepted.

(Item 12, a LoRA name with a lone surrogate, is in ``test_lora_server.py``; item 18,
``x-api-key``, in ``test_auth.py``.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.harness import ServerProcess, running_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather",
               "parameters": TOOLS[0]["function"]["parameters"]}]
MSG = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
       "messages": [{"role": "user", "content": "Hi"}]}
RESP = {"input": "Hi", "max_output_tokens": 1}
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with running_server(base_args=["--max-model-len", "256", "--max-num-seqs", "2"]) as s:
        yield s


def _post_raw(s: ServerProcess, path: str, text: str) -> httpx.Response:
    return httpx.post(s.url + path, content=text.encode(),
                      headers={"content-type": "application/json"}, timeout=120)


def _post(s: ServerProcess, path: str, body: Any) -> httpx.Response:
    # json.dumps writes NaN/Infinity as bare tokens (allow_nan), as a hostile client would.
    return _post_raw(s, path, json.dumps(body))


def _param(r: httpx.Response) -> Any:
    return r.json()["error"].get("param")


def _alive(s: ServerProcess) -> None:
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    r = _post(s, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text


def _assistant_call(arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _fn_call_input(arguments: str) -> list[dict[str, Any]]:
    return [{"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]


NAN, INF = float("nan"), float("inf")

BAD: list[tuple[str, Any, str | None]] = [
    # item 8: tool_choice shapes.
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": "get_weather"}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": ["get_weather"]}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": 7}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": ["auto"]},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "sometimes"},
     "tool_choice"),
    ("/v1/responses", {**RESP, "tools": RESP_TOOLS, "tool_choice": {
        "type": "allowed_tools", "function": "f"}}, "tool_choice"),
    ("/v1/responses", {**RESP, "tools": RESP_TOOLS, "tool_choice": {
        "type": "function", "name": ["get_weather"]}}, "tool_choice"),
    ("/v1/messages", {**MSG, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "tool", "name": {"n": "f"}}}, "tool_choice"),
    # item 9: JSON strings (and bodies) nested 100,000 deep.
    ("/v1/chat/completions", {**CHAT, "messages": _assistant_call(DEEP)},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/responses", {**RESP, "input": _fn_call_input(DEEP)}, "input.0.arguments"),
    # item 10: non-finite numbers, wherever they are.
    ("/v1/responses", {**RESP, "metadata": {"x": NAN}}, "metadata.x"),
    ("/v1/responses", {**RESP, "metadata": {"x": INF}, "stream": True}, "metadata.x"),
    ("/v1/responses", {**RESP, "tools": [{**RESP_TOOLS[0], "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": INF}}}}]},
     "tools.0.parameters.properties.n.maximum"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"x": -INF}}, "metadata.x"),
    ("/v1/chat/completions", {**CHAT, "temperature": NAN}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1": INF}},
     "logit_bias.1"),
    ("/v1/messages", {**MSG, "metadata": {"a": NAN}}, "metadata.a"),
    ("/v1/messages/count_tokens", {**MSG, "temperature": INF}, "temperature"),
    ("/tokenize", {"prompt": "hi", "x": NAN}, "x"),
    # item 14's other half: max_tokens 0 without echo stays a 400.
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in
                                                       enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(srv: ServerProcess, path: str, body: Any,
                                           param: str | None) -> None:
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    assert _param(r) == param, r.text
    assert "Traceback" not in r.text
    _alive(srv)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/v1/responses", "/v1/messages", "/tokenize"])
@pytest.mark.parametrize("text,param", [
    ('{"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}", "metadata"),
    ('{"metadata": {"x": 1e999}}', "metadata.x"),
    ('{"metadata": {"x": Infinity}}', "metadata.x"),
], ids=["deep", "overflow", "infinity"])
def test_bodies_are_strict_json_everywhere(srv: ServerProcess, path: str, text: str,
                                           param: str) -> None:
    """Item 9/10: the body parser itself (one place, every route) bounds nesting and
    refuses non-finite numbers before anything reads the body."""
    r = _post_raw(srv, path, text)
    assert r.status_code == 400, r.text
    assert _param(r) == param, r.text
    _alive(srv)


def test_responses_store_stays_readable(srv: ServerProcess) -> None:
    """Item 10: a refused body is never stored; a normal one is stored and readable, and
    its stream is valid JSON throughout."""
    r = _post(srv, "/v1/responses", {**RESP, "metadata": {"k": "v", "n": 1.5}})
    assert r.status_code == 200, r.text
    got = httpx.get(f"{srv.url}/v1/responses/{r.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json()["metadata"] == {"k": "v", "n": 1.5}
    with httpx.stream("POST", srv.url + "/v1/responses", timeout=120,
                      json={**RESP, "stream": True, "metadata": {"n": 2.5}}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:], parse_constant=lambda c: pytest.fail(c))
    _alive(srv)


def test_plain_text_arguments_still_render(srv: ServerProcess) -> None:
    """Item 9's bound is on nesting only: arguments that are not JSON (or shallow JSON)
    still reach the template as before."""
    for args in ("not json", '{"city": "Paris"}', "[" * 20 + "]" * 20):
        r = _post(srv, "/v1/chat/completions", {**CHAT, "messages": _assistant_call(args)})
        assert r.status_code == 200, r.text
        r = _post(srv, "/v1/responses", {**RESP, "input": _fn_call_input(args)})
        assert r.status_code == 200, r.text


# A tool whose "parameters" are no object: the forced call's arguments are a JSON string.
ENUM_TOOL = {"name": "say", "input_schema": {"type": "string", "enum": ["Paris", "Rome"]}}


def test_messages_tool_input_is_always_an_object(srv: ServerProcess) -> None:
    """Item 11: /v1/messages answered 500 when a call's arguments were no JSON object;
    ``tool_use.input`` is now that object, or ``{"value": ...}`` wrapping anything else,
    streamed or not; chat's arguments for the same call are valid JSON."""
    # Greedy: the three answers below are compared (the tools prompt of a template
    # without tool support leaves "Paris" and "Rome" close at temperature 1).
    body = {**MSG, "max_tokens": 16, "tools": [ENUM_TOOL], "temperature": 0,
            "tool_choice": {"type": "tool", "name": "say"}}
    r = _post(srv, "/v1/messages", body)
    assert r.status_code == 200, r.text
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1 and uses[0]["name"] == "say", r.text
    assert uses[0]["input"] in ({"value": "Paris"}, {"value": "Rome"}), r.text
    partial = ""
    with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True},
                      timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] != "error", ev
                if ev["type"] == "content_block_delta" and \
                        ev["delta"]["type"] == "input_json_delta":
                    partial += ev["delta"]["partial_json"]
    assert json.loads(partial) == uses[0]["input"]
    chat = _post(srv, "/v1/chat/completions", {
        **CHAT, "max_tokens": 16, "temperature": 0, "tools": [{"type": "function", "function": {
            "name": "say", "parameters": ENUM_TOOL["input_schema"]}}],
        "tool_choice": {"type": "function", "function": {"name": "say"}}})
    assert chat.status_code == 200, chat.text
    call = chat.json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == uses[0]["input"]["value"]
    _alive(srv)


def test_tool_input_unit() -> None:
    """Item 11, what a tool parser may hand over (no server needed to list the cases)."""
    from pagedllm.entrypoints.openai.serving_messages import tool_input

    assert tool_input('{"city": "Paris"}') == {"city": "Paris"}
    assert tool_input("Paris") == {"value": "Paris"}
    assert tool_input('"Paris"') == {"value": "Paris"}
    assert tool_input("3") == {"value": 3}
    assert tool_input("") == {}
    assert tool_input(DEEP) == {"value": DEEP}
    assert tool_input("NaN") == {"value": "NaN"}


def test_echo_with_zero_max_tokens_scores_the_prompt(srv: ServerProcess) -> None:
    """Item 14: echo + max_tokens 0 returns the prompt (with its logprobs) and nothing
    generated, streamed or not, for text and token-id prompts (as vLLM)."""
    base = {"prompt": "The capital of France is", "max_tokens": 0, "echo": True,
            "logprobs": 1}
    r = _post(srv, "/v1/completions", base)
    assert r.status_code == 200, r.text
    out = r.json()
    ch = out["choices"][0]
    assert ch["text"] == base["prompt"]
    assert ch["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    n_prompt = out["usage"]["prompt_tokens"]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_prompt
    assert lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == base["prompt"]
    # Streamed: the same text, no generated token ids.
    text, ids = "", []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
            **base, "stream": True, "return_token_ids": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                ids += c["token_ids"]
    assert text == base["prompt"] and ids == []
    # Token ids, n=2, no logprobs.
    r = _post(srv, "/v1/completions", {"prompt": [504, 3575, 282], "max_tokens": 0,
                                       "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0]
    assert r.json()["usage"]["completion_tokens"] == 0
    _alive(srv)
