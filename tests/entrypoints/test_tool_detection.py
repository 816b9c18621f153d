"""Tool support decided at start-up (``tool_detection.resolve``) and the prompt fallback's
pieces (``tool_prompt``): the system prompt, the rewritten history and the structural-tag
grammar (checked with xgrammar's own matcher on byte strings)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_detection import detect_parser, resolve
from pagedllm.entrypoints.openai.tool_prompt import call_grammar, fallback_messages

HERMES = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
          "{% endfor %}</tools> Call with <tool_call>{...}</tool_call><|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "<|im_end|>\n{% endfor %}")
MISTRAL = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")
LLAMA3 = ("{% if tools %}<|start_header_id|>user<|end_header_id|>{{ tools | tojson }}"
          "{% endif %}<|python_tag|>")
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
WEATHER = {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {
    "tz": {"type": "string"}}, "required": ["tz"]}}


@pytest.mark.parametrize(("template", "model_type", "parser"), [
    (HERMES, "qwen2", "hermes"), (MISTRAL, "mistral", "mistral"),
    (LLAMA3, "llama", "llama3_json"), (PLAIN, "llama", None), (None, "qwen2", None),
    ("{% if tools %}{{ tools }}{% endif %}", "qwen2", "hermes"),  # the config decides
    ("{% if tools %}{{ tools }}{% endif %}", "gpt2", None), ("{% if", "qwen2", None)])
def test_detect_parser(template: str | None, model_type: str, parser: str | None) -> None:
    assert detect_parser(template, model_type) == parser


def test_resolve_detects_falls_back_and_flags_override() -> None:
    d = resolve(None, False, HERMES, "qwen2")
    assert (d.parser, d.auto, d.prompt_fallback) == ("hermes", True, False)
    assert "hermes detected" in d.summary
    f = resolve(None, False, PLAIN, "llama")
    assert (f.parser, f.auto, f.prompt_fallback) == ("hermes", True, True)
    assert "no tool support" in f.summary
    # --enable-auto-tool-choice alone: detection as well.
    assert resolve(None, True, PLAIN, "llama").prompt_fallback
    # Explicit flags win, as in vLLM: no fallback, auto only with the flag.
    x = resolve("llama3_json", False, HERMES, "qwen2")
    assert (x.parser, x.auto, x.prompt_fallback) == ("llama3_json", False, False)
    assert resolve("mistral", True, PLAIN, "llama").auto
    off = resolve("none", False, HERMES, "qwen2")
    assert (off.parser, off.auto, off.prompt_fallback) == (None, False, False)


def test_fallback_messages_prompt_and_history() -> None:
    call = {"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}
    msgs = fallback_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}], [WEATHER])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    sys_text = msgs[0]["content"]
    assert sys_text.startswith("Be brief.\n\n") and "<tool_call>" in sys_text
    line = next(x for x in sys_text.splitlines() if x.startswith('{"name": "get_weather"'))
    assert json.loads(line)["parameters"] == WEATHER["parameters"]
    assert msgs[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>')
    assert msgs[3]["content"] == "<tool_response>\n3 C\n</tool_response>"
    # No tools (tool_choice "none"): the history only; a new system message otherwise.
    assert fallback_messages([{"role": "user", "content": "Hi"}], []) == [
        {"role": "user", "content": "Hi"}]
    assert fallback_messages([{"role": "user", "content": "Hi"}], [TIME])[0]["role"] == \
        "system"


def _accepts(grammar: str, text: str, end: bool = True) -> bool:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return m.accept_string(text) and (not end or m.is_terminated())


CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "celsius"}}\n</tool_call>')


def test_call_grammar_free_text_then_a_schema_bound_call() -> None:
    auto = call_grammar([WEATHER, TIME], forced=False, single=True)
    assert _accepts(auto, "Just text, no call.")
    assert _accepts(auto, "Let me check.\n" + CALL)
    assert not _accepts(auto, CALL.replace("celsius", "kelvin"), end=False)
    assert not _accepts(auto, CALL + "\nmore text", end=False)  # nothing after a call
    forced = call_grammar([WEATHER, TIME], forced=True, single=True)
    assert _accepts(forced, CALL)
    assert not _accepts(forced, "Text first", end=False)
    assert not _accepts(forced, CALL + "\n" + CALL, end=False)
    several = call_grammar([WEATHER, TIME], forced=True, single=False)
    assert _accepts(several, CALL + "\n" + CALL.replace(
        '"get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}',
        '"get_time", "arguments": {"tz": "UTC"}'))
    named = call_grammar([TIME], forced=True, single=True)
    assert not _accepts(named, CALL, end=False)
