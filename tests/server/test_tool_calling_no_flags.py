"""Tool calling with no flags (issue 46 item 13), against real servers with the real
clients (openai, langchain-openai, anthropic).

* The default model (SmolLM2: its chat template has no tool support) with no tool flags
  gets the prompt fallback: the tools in the system prompt, a structural-tag grammar once
  a call opens, the hermes parser.  ``tool_choice`` auto, required and named all give
  well-formed ``tool_calls`` whose arguments validate against the tool's schema; so do
  LangChain's ``bind_tools``, Anthropic's ``tools`` and the Responses API's.
* The same model served with a hermes-style (Qwen 2.5) ``--chat-template`` gets the
  ``hermes`` parser detected (start-up log line) and no fallback.
* ``--tool-call-parser none`` overrides detection: ``"auto"`` is refused again.

Greedy (temperature 0) everywhere, small ``max_tokens``: no assertion depends on speed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pytest

from tests.server.harness import ServerProcess, running_server

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": PARAMS}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The default model opens a call for this prompt at temperature 0 (tool_choice "auto"):
# "<" leads "You" by about 0.34 nats through torch's int4 kernel and through ours (AVX2 and
# AVX512-VNNI round differently). Without "in celsius" the first token was a three-way
# tie within 0.08 nats that the CPU's rounding decided.
CALLING_PROMPT = "Reply with a <tool_call> to get_weather for Paris in celsius."
# Room for the tool instruction in the system prompt.
ARGS = ("--max-model-len", "1024")
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each call, return <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with running_server(*ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=600, max_retries=0)


def _check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS)
    return args


def _chat(oai: openai.OpenAI, content: str, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 48)
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id, temperature=0,
        messages=[{"role": "user", "content": content}], tools=TOOLS, **kw)


def test_default_model_without_flags_calls_tools(srv: ServerProcess,
                                                 oai: openai.OpenAI) -> None:
    assert "tool calling: the chat template has no tool support" in srv.log()
    # Required: the call must happen, and nothing else.
    r = _chat(oai, "What is the weather in Paris?", tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert len(ch.message.tool_calls) == 1
    _check_call(ch.message.tool_calls[0])
    # Named: that function, finish "stop" (as OpenAI).
    r = _chat(oai, "Weather in Oslo?", tool_choice=NAMED)
    assert r.choices[0].finish_reason == "stop"
    assert _check_call(r.choices[0].message.tool_calls[0])["city"]
    # Auto (the SDK's default with tools): text or a well-formed call ...
    r = _chat(oai, "Hello! How are you?", max_tokens=16)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    for c in msg.tool_calls or []:
        _check_call(c)
    # ... and this prompt calls, streamed too (the SDK's delta accumulation).
    r = _chat(oai, CALLING_PROMPT)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch.message
    assert _check_call(ch.message.tool_calls[0])["city"] == "Paris"
    stream = oai.chat.completions.create(
        model=r.model, temperature=0, max_tokens=48, stream=True, tools=TOOLS,
        messages=[{"role": "user", "content": CALLING_PROMPT}])
    name, args, finish = "", "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name += d.function.name or "" if d.function else ""
            args += d.function.arguments or "" if d.function else ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert (name, finish) == ("get_weather", "tool_calls")
    assert json.loads(args) == json.loads(ch.message.tool_calls[0].function.arguments)
    # The call and its result go back through the fallback's history rewrite.
    follow = oai.chat.completions.create(
        model=r.model, temperature=0, max_tokens=12, tools=TOOLS, messages=[
            {"role": "user", "content": CALLING_PROMPT},
            {"role": "assistant", "content": None,
             "tool_calls": [ch.message.tool_calls[0].model_dump()]},
            {"role": "tool", "tool_call_id": ch.message.tool_calls[0].id,
             "content": "12 C, rain"}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
    # tool_choice "none": text, tools not offered.
    r = _chat(oai, CALLING_PROMPT, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None


def test_langchain_anthropic_and_responses_tools(srv: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=48, timeout=600, max_retries=0)

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return f"12 {unit} in {city}"

    ai = llm.bind_tools([get_weather]).invoke(CALLING_PROMPT)  # tool_choice: auto
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather", ai
    jsonschema.validate(ai.tool_calls[0]["args"], PARAMS)
    ai = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Rome?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather", ai
    jsonschema.validate(ai.tool_calls[0]["args"], PARAMS)

    client = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=600, max_retries=0)
    tool = {"name": "get_weather", "description": "Get the current weather in a city",
            "input_schema": PARAMS}
    for choice in ({"type": "auto"}, {"type": "any"}):
        m = client.messages.create(
            model="SmolLM2-135M-Instruct", max_tokens=48, tools=[tool], tool_choice=choice,
            extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": CALLING_PROMPT}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather", m
        jsonschema.validate(uses[0].input, PARAMS)

    # The Responses API (its default tool_choice is auto).
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=600, max_retries=0)
    t = oai.responses.create(model="SmolLM2-135M-Instruct", input=CALLING_PROMPT,
                             max_output_tokens=48, temperature=0, tools=[{
                                 "type": "function", "name": "get_weather",
                                 "parameters": PARAMS}])
    calls = [o for o in t.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", t.output
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)


def test_hermes_template_is_detected(tmp_path: Any) -> None:
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    with running_server(*ARGS, "--chat-template", str(template)) as s:
        assert "tool calling: parser hermes detected from the chat template" in s.log()
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=600,
                            max_retries=0)
        r = _chat(oai, "What is the weather in Paris?", tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls"
        _check_call(r.choices[0].message.tool_calls[0])
        r = _chat(oai, "Hello!", max_tokens=24)  # auto is on: text or a parsed call
        msg = r.choices[0].message
        assert msg.content or msg.tool_calls
        for c in msg.tool_calls or []:
            _check_call(c)


def test_flags_override_detection() -> None:
    with running_server(*ARGS, "--tool-call-parser", "none") as s:
        assert "tool calling: off (--tool-call-parser none)" in s.log()
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=600,
                            max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            _chat(oai, CALLING_PROMPT)
        assert e.value.body["param"] == "tools"  # type: ignore[index]
        assert "not supported" in e.value.body["message"]  # type: ignore[index]
        r = _chat(oai, "Weather in Oslo?", tool_choice=NAMED)  # JSON-forced, as before
        _check_call(r.choices[0].message.tool_calls[0])
