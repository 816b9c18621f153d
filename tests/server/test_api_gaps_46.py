"""API gaps of issue 46 against the shared real server: ``/tokenize`` in vLLM's chat
form with ``tools`` and ``chat_template_kwargs`` (item 15), and the metrics page without
``_created`` series or spec-decode counters when speculation is off (item 20)."""

from __future__ import annotations

import httpx

from tests.server.harness import ServerProcess

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_tokenize_chat_form_takes_tools_and_template_kwargs(server: ServerProcess) -> None:
    with server.client() as c:
        plain = c.post("/tokenize", json={"messages": MESSAGES})
        assert plain.status_code == 200, plain.text
        body = {"messages": MESSAGES, "tools": TOOLS,
                "chat_template_kwargs": {"enable_thinking": False}}
        r = c.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        # The same prompt the chat endpoint renders for the same fields.
        chat = c.post("/v1/chat/completions", json={
            **body, "max_tokens": 1, "tool_choice": "none"})
        assert chat.status_code == 200, chat.text
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
        cont = c.post("/tokenize", json={
            "messages": [*MESSAGES, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False, "continue_final_message": True})
        assert cont.status_code == 200, cont.text
        for bad, param in (({"chat_template_kwargs": {"messages": []}},
                            "chat_template_kwargs"),
                           ({"continue_final_message": True}, "continue_final_message"),
                           ({"tools": "get_weather"}, None)):
            r = c.post("/tokenize", json={"messages": MESSAGES, **bad})
            assert r.status_code == 400, r.text
            if param:
                assert r.json()["error"]["param"] == param
        assert c.get("/health").status_code == 200


def test_metrics_have_no_created_series_nor_spec_decode_without_speculation(
        server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "vllm:prompt_tokens_total" in text
    assert "_created" not in text
    assert "spec_decode" not in text
