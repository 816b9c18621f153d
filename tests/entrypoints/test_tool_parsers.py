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
