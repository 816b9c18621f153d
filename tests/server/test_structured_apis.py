"""Structured outputs, tools, and the Anthropic Messages / OpenAI Responses APIs against
one real server on loopback, with the real clients (openai, anthropic, langchain-openai).

Every constrained output is checked with ``jsonschema`` / ``re``; tool-call arguments
against the tool's own schema.  The server runs with ``--enable-auto-tool-choice
--tool-call-parser hermes``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.harness import ServerProcess, running_server

S = {"type": "string", "maxLength": 8}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S,
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "y": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x", "y"],
        "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string",
                                               "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0,
                                                       "maximum": 9}, S]}},
     "required": ["v"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0,
                                                "maximum": 1}}, "required": ["score"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"},
                                      "n": {"type": "integer", "minimum": 1,
                                            "maximum": 3}},
     "required": ["kind", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^20[0-9]{2}-[01][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2,
                                                "items": {"type": "object", "properties": {
                                                    "id": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}},
                                                    "required": ["id"],
                                                    "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["on", "off"]},
                                      "level": {"type": "integer", "minimum": 1,
                                                "maximum": 5}},
     "required": ["status", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"a": S, "b": S}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": ["integer", "null"], "minimum": 0,
                                            "maximum": 9}}, "required": ["x"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2,
                                               "maxLength": 5}}, "required": ["word"]},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {
        "n": {"type": "object", "properties": {"k": {"type": "boolean"}},
              "required": ["k"], "additionalProperties": False}},
        "required": ["n"], "additionalProperties": False}}, "required": ["m"],
     "additionalProperties": False},
    {"type": "object", "properties": {"hex": {"type": "string",
                                              "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["hex"]},
    {"type": "object", "properties": {"choice": {"oneOf": [
        {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
         "additionalProperties": False},
        {"type": "object", "properties": {"no": {"type": "integer", "minimum": 0,
                                                 "maximum": 3}}, "required": ["no"],
         "additionalProperties": False}]}}, "required": ["choice"],
     "additionalProperties": False},
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                           "maxLength": 16}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with running_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        base_args=["--max-model-len", "512", "--max-num-seqs", "20"]) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv: ServerProcess) -> openai.OpenAI:
    # Generous timeouts: CI machines can be slow; nothing here is timed.
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=1200, max_retries=0)


def _chat(oai: openai.OpenAI, content: str, **kw: Any) -> Any:
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id if "model" not in kw else kw.pop("model"),
        messages=[{"role": "user", "content": content}], temperature=0, **kw)


def test_json_schemas_concurrently(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id

    def one(i: int) -> tuple[int, Any]:
        r = oai.chat.completions.create(
            model=model, temperature=0, max_tokens=96,
            messages=[{"role": "user", "content": "Reply with JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": SCHEMAS[i], "strict": True}})
        return i, r.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, range(len(SCHEMAS))))
    for i, choice in results:
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])


class Pet(BaseModel):
    name: str = Field(max_length=10)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


def test_parse_with_pydantic_and_other_spellings(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    r = oai.chat.completions.parse(model=model, temperature=0, max_tokens=64,
                                   messages=[{"role": "user", "content": "Describe a pet."}],
                                   response_format=Pet)
    assert isinstance(r.choices[0].message.parsed, Pet)
    r2 = _chat(oai, "Phone number?", max_tokens=16,
               extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r2.choices[0].message.content)
    r3 = _chat(oai, "Yes or no?", max_tokens=4, n=2,
               extra_body={"guided_choice": ["yes", "no"]})
    assert {c.message.content for c in r3.choices} <= {"yes", "no"}
    r4 = _chat(oai, "JSON please", max_tokens=48, response_format={"type": "json_object"})
    if r4.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r4.choices[0].message.content), dict)
    c = oai.completions.create(model=model, prompt="The answer is", max_tokens=8,
                               temperature=0, extra_body={
                                   "guided_grammar": 'root ::= " " ("yes" | "no") "."'})
    assert re.fullmatch(r" (yes|no)\.", c.choices[0].text)
    # Streaming: the deltas concatenate to a valid document.
    stream = oai.chat.completions.create(
        model=model, temperature=0, max_tokens=64, stream=True,
        messages=[{"role": "user", "content": "A pet as JSON"}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "pet", "schema": Pet.model_json_schema()}})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    Pet.model_validate_json(text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_regex": "x[^\\s\\S]"}, "guided_regex"),  # an empty language
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function",
                                      "function": {"name": "absent"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice"),
    # Wrongly typed fields used to pass the API and hang the request (issue 46 item 3).
    *[({"structured_outputs": {"json_object": True, "disable_any_whitespace": v}},
       "structured_outputs.disable_any_whitespace") for v in ("yes", {}, None, 0)],
    *[({"structured_outputs": {"json_object": v}}, "structured_outputs.json_object")
      for v in (1, "true")],
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"},
      "stream": True}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_constraints_are_400_naming_the_field(srv: ServerProcess, extra: dict,
                                                   param: str) -> None:
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "/project" not in err["message"]
        ok = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments),
                            SCHEMA_OF[call.function.name])


def test_tool_choice_required_named_auto_and_streaming(oai: openai.OpenAI) -> None:
    r = _chat(oai, "What is the weather in Paris?", tools=TOOLS, tool_choice="required",
              max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})
    r = _chat(oai, "Weather in Oslo?", tools=TOOLS, max_tokens=60, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    _check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    call = r.choices[0].message.tool_calls[0]
    # Streamed: OpenAI's tool-call delta shape, accumulated as the SDK users do.
    stream = oai.chat.completions.create(
        model=oai.models.list().data[0].id, temperature=0, max_tokens=60, stream=True,
        messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    acc: dict[int, dict[str, str]] = {}
    for ch in stream:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            slot = acc.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
    assert acc == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # The tool result goes back through the template (tool role, tool_call_id).
    follow = oai.chat.completions.create(
        model=oai.models.list().data[0].id, temperature=0, max_tokens=16, tools=TOOLS,
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function", "function": {
                          "name": call.function.name,
                          "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}])
    assert follow.choices[0].message.content is not None or \
        follow.choices[0].message.tool_calls
    # auto (hermes parser): whatever the model says comes back as content or calls.
    auto = _chat(oai, "Hello!", tools=TOOLS, max_tokens=12)
    msg = auto.choices[0].message
    assert msg.content or msg.tool_calls


def test_langchain_structured_output_and_bind_tools(srv: ServerProcess) -> None:
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model="SmolLM2-135M-Instruct",
                     temperature=0, max_tokens=64, timeout=1200, max_retries=0)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather for a city."""
        return f"12 {unit} in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    ai = bound.invoke("Weather in Rome?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    args = ai.tool_calls[0]["args"]
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    reply = llm.bind_tools([get_weather]).invoke(
        ["Weather in Rome?", ai, ToolMessage(get_weather(**args),
                                             tool_call_id=ai.tool_calls[0]["id"])])
    assert reply.content is not None


def test_anthropic_messages(srv: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=1200, max_retries=0)
    kw: dict[str, Any] = dict(model="SmolLM2-135M-Instruct", max_tokens=8,
                              extra_body={"temperature": 0.0}, system="You are terse.",
                              messages=[
                                  {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello."},
                                  {"role": "user", "content": "Name a colour."}])
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.stop_reason == m.stop_reason
    first = m.content[0].text.split()[0] if m.content[0].text.split() else ""
    if first:
        stopped = client.messages.create(**{**kw, "stop_sequences": [first]})
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == first
    n = client.messages.count_tokens(model=kw["model"], system=kw["system"],
                                     messages=kw["messages"])
    assert n.input_tokens == m.usage.input_tokens
    tool = {"name": "get_weather", "description": "weather",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    t = client.messages.create(model=kw["model"], max_tokens=40,
                               extra_body={"temperature": 0.0},
                               messages=[{"role": "user", "content": "Weather in Rome?"}],
                               tools=[tool], tool_choice={"type": "tool",
                                                          "name": "get_weather"})
    uses = [b for b in t.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, SCHEMA_OF["get_weather"])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=kw["model"], max_tokens=0, messages=kw["messages"])
    assert "max_tokens" in str(e.value)


def test_openai_responses(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    r = oai.responses.create(model=model, input="Name a fruit.", instructions="Be brief.",
                             max_output_tokens=10, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    again = oai.responses.create(model=model, input="And another one?",
                                 previous_response_id=r.id, max_output_tokens=6,
                                 temperature=0)
    assert again.output_text and again.usage.input_tokens > r.usage.input_tokens
    events = list(oai.responses.create(model=model, input="Name a fruit.",
                                       instructions="Be brief.", max_output_tokens=10,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    t = oai.responses.create(model=model, input="Weather in Rome?", max_output_tokens=60,
                             temperature=0, tool_choice="required", tools=[{
                                 "type": "function", "name": "get_weather",
                                 "parameters": SCHEMA_OF["get_weather"]}])
    calls = [o for o in t.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA_OF["get_weather"])
    # Room for the grammar's optional whitespace (runs of up to 16) around every token.
    j = oai.responses.create(model=model, input="A pet", max_output_tokens=256,
                             temperature=0, text={"format": {
                                 "type": "json_schema", "name": "pet",
                                 "schema": Pet.model_json_schema(), "strict": True}})
    Pet.model_validate_json(j.output_text)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{oai.base_url}responses/{r.id}", timeout=30).json()["id"] == r.id


def test_auto_tool_call_streams_arguments_incrementally(oai: openai.OpenAI) -> None:
    # The small model does not call tools of its own accord: a regex makes it write a
    # hermes call, which the auto parser then finds (streamed and not).
    call_rx = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
               r'"[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>')
    kw: dict[str, Any] = dict(
        model=oai.models.list().data[0].id, temperature=0, max_tokens=120, tools=TOOLS,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        extra_body={"structured_outputs": {"regex": call_rx}})
    whole = oai.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0].message
    [call] = whole.choices[0].message.tool_calls
    heads, fragments, args = 0, 0, ""
    for ch in oai.chat.completions.create(stream=True, **kw):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            assert tc.index == 0
            if tc.id:  # the first delta: id, type and name
                heads += 1
                assert tc.type == "function" and tc.function.name == "get_weather"
            else:
                assert tc.function.name is None
                fragments += 1
            args += tc.function.arguments or ""
    assert heads == 1 and fragments > 1  # the arguments came in pieces
    assert args == call.function.arguments
    jsonschema.validate(json.loads(args), SCHEMA_OF["get_weather"])
