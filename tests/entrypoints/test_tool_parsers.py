"""Tool-call parsers against outputs written as each model family emits them, whole and
streamed in small random pieces; malformed calls fall back to plain content."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolCallStream, get_tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Berlin"}

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": '
     + json.dumps(WEATHER) + '}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     + json.dumps(WEATHER) + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": ' + json.dumps(TIME) + '}\n</tool_call>', "Let me check.\n",
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("hermes", "The weather in Paris is 21°C, sunny. ☀️", "The weather in Paris is 21°C, "
     "sunny. ☀️", []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '
     + json.dumps(WEATHER) + '}; {"name": "get_time", "parameters": '
     + json.dumps(TIME) + "}", None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": '
     + json.dumps(WEATHER) + '}, {"name": "get_time", "arguments": '
     + json.dumps(TIME) + "}]", None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("llama3_json", '{"title": "not a call"}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"'),
    ("mistral", "[TOOL_CALLS] sorry"),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(name: str, text: str, seed: int) -> tuple[str, list[dict]]:
    rng = random.Random(seed)
    s = ToolCallStream(get_tool_parser(name))
    content, calls, i = "", [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        c, new = s.feed(text[i:i + n])
        content += c
        calls += new
        i += n
    c, new = s.finish()
    return content + c, calls + new


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_extract_whole_and_streamed(name: str, text: str, content: str | None,
                                    expected: list) -> None:
    got_content, calls = get_tool_parser(name).extract(text)
    assert got_content == content
    assert _calls(calls) == expected
    for seed in range(5):
        s_content, s_calls = _stream(name, text, seed)
        assert s_content == (content or "")
        assert _calls(s_calls) == expected


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_falls_back_to_text(name: str, text: str) -> None:
    content, calls = get_tool_parser(name).extract(text)
    assert (content, calls) == (text, [])
    for seed in range(5):
        assert _stream(name, text, seed) == (text, [])


def test_unknown_parser_names_the_flag() -> None:
    with pytest.raises(ValueError, match="tool-call-parser"):
        get_tool_parser("nope")


# ---------------------------------------------------------------- incremental streaming

def _stream_incremental(name: str, text: str, sizes: list[int]) -> tuple[str, dict]:
    """Feed ``text`` in pieces of ``sizes`` (cycled); the content and, per call index,
    its deltas as a client sees them."""
    s = ToolCallStream(get_tool_parser(name), incremental=True)
    pieces, i = [], 0
    while i < len(text):
        n = sizes[len(pieces) % len(sizes)]
        pieces.append(text[i:i + n])
        i += n
    content, per_call = "", {}
    for c, deltas in [s.feed(p) for p in pieces] + [s.finish()]:
        content += c
        for d in deltas:
            per_call.setdefault(d["index"], []).append(d)
    return content, per_call


@pytest.mark.parametrize("name, text, content, expected", CASES)
@pytest.mark.parametrize("sizes", [[1], [3, 1, 5], [2, 7]])
def test_incremental_arguments_in_openai_shape(name: str, text: str,
                                               content: str | None, expected: list,
                                               sizes: list[int]) -> None:
    whole_content, whole_calls = get_tool_parser(name).extract(text)
    got, per_call = _stream_incremental(name, text, sizes)
    assert got == (whole_content or "")
    assert sorted(per_call) == list(range(len(whole_calls)))
    for idx, deltas in per_call.items():
        head, rest = deltas[0], deltas[1:]
        assert head["type"] == "function" and head["id"].startswith("call_")
        assert head["function"]["name"] == whole_calls[idx]["function"]["name"]
        assert head["function"]["arguments"] == ""
        for d in rest:  # later deltas: argument fragments only
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        args = "".join(d["function"]["arguments"] for d in deltas)
        assert args == whole_calls[idx]["function"]["arguments"]  # exactly, as text
        if sizes == [1]:  # fed a character at a time, the arguments came in pieces
            assert len(rest) > 3
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole_calls] == expected


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>not json</tool_call> after"),
    ("llama3_json", '{"title": "not a call"}'),
    ("mistral", "[TOOL_CALLS] sorry"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} '
     "trailing junk</tool_call>"),
])
def test_incremental_malformed_falls_back_to_text(name: str, text: str) -> None:
    whole_content, whole_calls = get_tool_parser(name).extract(text)
    for sizes in ([1], [4, 2]):
        content, per_call = _stream_incremental(name, text, sizes)
        if not per_call:  # nothing streamed: exactly the non-streamed result
            assert (content, whole_calls) == (text, [])
            continue
        # A head was sent before the body turned out malformed: the call keeps the
        # argument text sent so far (valid JSON here) and the rest comes as content.
        assert whole_calls == [] and len(per_call) == 1
        args = "".join(d["function"]["arguments"] for d in per_call[0])
        assert json.loads(args) == {"city": "Paris"}
        assert "trailing junk" in content


def test_incremental_call_cut_short_keeps_its_head() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, per_call = _stream_incremental("hermes", text, [2])
    assert content == ""
    args = "".join(d["function"]["arguments"] for d in per_call[0])
    assert per_call[0][0]["function"]["name"] == "get_weather"
    assert args == '{"city": "Par'  # what the model wrote, as OpenAI does on "length"


def test_incremental_other_key_order_is_sent_whole() -> None:
    text = '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
    _, [call] = get_tool_parser("hermes").extract(text)
    content, per_call = _stream_incremental("hermes", text, [1])
    assert content == "" and len(per_call[0]) == 1  # one delta: the whole call
    assert per_call[0][0]["function"] == call["function"]
