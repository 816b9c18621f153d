"""Tools, tool choice and reasoning for ``/v1/chat/completions``.

``tool_choice`` (``tools`` given):

* ``"none"``: the tools are shown to the template, the output is text;
* ``"auto"`` (the default with tools): needs ``--enable-auto-tool-choice`` and a
  ``--tool-call-parser``; the parser finds calls in the output, text stays content;
* ``"required"``: a grammar forces a JSON array of ``{"name", "parameters"}`` objects
  (one of the tools each, its parameters schema; one item when
  ``parallel_tool_calls`` is false);
* ``{"type": "function", "function": {"name": N}}``: a grammar forces the arguments
  object of tool N.

With the *prompt fallback* (a template without tool support, ``tool_detection.py``) the
server writes the tools into the system prompt and every choice uses one structural-tag
grammar (``tool_prompt.call_grammar``): ``"auto"`` lets the model write text until it
opens ``<tool_call>``, ``"required"`` and a named function force a call from the first
token; the ``hermes`` parser reads the calls (``ToolMode.parsed``).

:class:`ChoiceShaper` turns one choice's raw text into the message (``content``,
``reasoning_content``, ``tool_calls``) and, streaming, into OpenAI's deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.reasoning_parsers import (
    END,
    ReasoningParser,
    ReasoningStream,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.parsers import tool_call
from pagedllm.structured_outputs_params import StructuredOutputsParams


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The ``function`` objects of ``tools`` (400 naming ``tools`` when malformed)."""
    out = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError("tools must be objects {\"type\": \"function\", "
                               "\"function\": {\"name\", \"parameters\"}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools: parameters of {fn['name']!r} must be a JSON "
                               "schema object", "tools")
        out.append(fn)
    return out


def offline_tool_chat(convs: list[list[dict[str, Any]]], tools: list[dict[str, Any]],
                      template: Any) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """What offline ``LLM.chat(tools=...)`` renders, as the server does: the
    conversations and the template's extra variables.  A ``template`` (a Jinja string)
    that reads ``tools`` gets them as its ``tools`` variable; any other gets the prompt
    fallback (``tool_prompt.fallback_messages``).  ``ValueError`` naming ``tools`` when
    they are not OpenAI function tools.  Offline the reply is text: nothing constrains or
    parses the call."""
    from pagedllm.entrypoints.openai.tool_detection import template_uses_tools
    from pagedllm.entrypoints.openai.tool_prompt import fallback_messages

    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got "
                         f"{type(tools).__name__}")
    fns = function_tools(tools)
    if template_uses_tools(template if isinstance(template, str) else None):
        return convs, {"tools": tools}
    return [fallback_messages(c, fns) for c in convs], {}


def _params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How a request's output is read: ``kind`` is ``none`` (text), ``auto``,
    ``required`` or ``named`` (``name`` set)."""

    kind: str = "none"
    name: str | None = None
    constraint: StructuredOutputsParams | None = None
    # The tool parser reads the calls (prompt fallback), not the JSON-array reader.
    parsed: bool = False


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any,
              parallel_tool_calls: bool | None, auto_enabled: bool,
              fallback: bool = False) -> ToolMode:
    """How the request's output is constrained and read; ``fallback``: the server's
    prompt fallback (the tools are in the system prompt, calls in ``<tool_call>``)."""
    mode = _tool_mode(tools, tool_choice, parallel_tool_calls, auto_enabled)
    if not fallback or mode.kind == "none":
        return mode
    fns = function_tools(tools)
    if mode.kind != "auto" and any(_params_schema(f).get("type") != "object" for f in fns):
        # Arguments that are no object (a string, an enum): the JSON-forced call keeps
        # them JSON text, which the hermes parser (taking a string as JSON) would not.
        return mode
    for f in fns:  # the up-front size bounds, before xgrammar sees a schema
        _constraint(_params_schema(f))
    if mode.kind == "named":
        fns = [f for f in fns if f["name"] == mode.name]
    forced = mode.kind != "auto"
    # One call unless the request asks for parallel calls outright: a small model, once
    # it has called, tends to repeat the call until max_tokens.
    single = mode.kind == "named" or parallel_tool_calls is not True
    from pagedllm.entrypoints.openai.tool_prompt import call_grammar

    try:
        grammar = call_grammar(fns, forced, single)
    except ValueError as e:
        raise RequestError(f"tools: {e}", "tools") from None
    so = StructuredOutputsParams(grammar=grammar, origin="tools")
    _check(so)
    return ToolMode(mode.kind, mode.name, so, parsed=True)


def _tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None, auto_enabled: bool) -> ToolMode:
    fns = function_tools(tools)
    implicit = tool_choice is None
    if implicit:
        tool_choice = "auto" if fns else "none"
    if tool_choice == "none":
        return ToolMode()
    if not fns:
        raise RequestError("tool_choice needs tools", "tool_choice")
    if tool_choice == "auto":
        if not auto_enabled:
            # Named after what the client sent: tools alone imply "auto".
            raise RequestError('"auto" tool choice is not supported by this server '
                               "unless it runs with --enable-auto-tool-choice and "
                               '--tool-call-parser (use "required", a named function '
                               'or "none")', "tools" if implicit else "tool_choice")
        return ToolMode("auto")
    if tool_choice == "required":
        item = {"anyOf": [{
            "type": "object", "additionalProperties": False,
            "required": ["name", "parameters"],
            "properties": {"name": {"type": "string", "enum": [f["name"]]},
                           "parameters": _params_schema(f)}} for f in fns]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolMode("required", None, _constraint(schema))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}',
                               "tool_choice")
        match = [f for f in fns if f["name"] == name]
        if not match:
            raise RequestError(f"tool_choice names the function {name!r}, which is not "
                               "in tools", "tool_choice")
        return ToolMode("named", name, _constraint(_params_schema(match[0])))
    raise RequestError('tool_choice must be "none", "auto", "required" or a named '
                       "function", "tool_choice")


def _check(so: StructuredOutputsParams) -> None:
    from pagedllm.entrypoints.openai.structured import check_size

    check_size(so)


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Compact JSON: a small model given free whitespace can spend its tokens on it.
    # Sized here; parsed and compiled off the event loop (``ServingState.start``).
    try:
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                     origin="tools")
    except ValueError as e:
        raise RequestError(f"tools: {str(e).splitlines()[0]}", "tools") from None
    _check(so)
    return so


def _forced_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The calls of a grammar-forced output (None if it is incomplete: cut by length)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested beyond the parser
        return None
    # tool_call takes a str as JSON text already: a decoded JSON string (a tool whose
    # parameters schema is not an object) is written back out, so arguments stay JSON.
    def args(v: Any) -> Any:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, str) else v

    if mode.kind == "named":
        assert mode.name is not None
        return [tool_call(mode.name, args(obj))]
    return [tool_call(c["name"], args(c.get("parameters", {}))) for c in obj]


@dataclass
class ChoiceShaper:
    """One choice's text -> message fields (and streamed deltas)."""

    mode: ToolMode = field(default_factory=ToolMode)
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    # Stream tool-call arguments in fragments (chat completions); else calls come whole.
    incremental_tools: bool = False
    _reasoning: ReasoningStream | None = None
    _tools: ToolCallStream | None = None
    _text: str = ""
    _num_calls: int = 0

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            self._reasoning = ReasoningStream(self.reasoning_parser)
        if (self.mode.kind == "auto" or self.mode.parsed) and self.tool_parser is not None:
            self._tools = ToolCallStream(self.tool_parser, self.incremental_tools)

    @property
    def plain(self) -> bool:
        return self.mode.kind == "none" and self.reasoning_parser is None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(assistant message, whether it holds tool calls)."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            msg["reasoning_content"] = reasoning
        calls: list[dict[str, Any]] | None = []
        if self.mode.kind in ("required", "named") and not self.mode.parsed:
            calls = _forced_calls(self.mode, content or "")
            if calls:
                msg["content"] = None
        elif (self.mode.kind == "auto" or self.mode.parsed) and self.tool_parser is not None:
            msg["content"], calls = self.tool_parser.extract(content or "")
        if calls:
            msg["tool_calls"] = calls
        elif msg["content"] is None and self.mode.kind == "none" and reasoning is None:
            msg["content"] = ""
        return msg, bool(calls)

    def delta(self, text: str, final: bool = False) -> tuple[dict[str, Any], bool]:
        """The delta for new ``text`` (and, with ``final``, whatever was held back)."""
        d: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            r, content = (self._reasoning.feed(text) if not final
                          else _join(self._reasoning.feed(text), self._reasoning.finish()))
            if r:
                d["reasoning_content"] = r
        calls: list[dict[str, Any]] = []
        if self._tools is not None:  # its deltas carry their index already
            content, tool_deltas = (self._tools.feed(content) if not final else
                                    _join(self._tools.feed(content), self._tools.finish()))
            if content:
                d["content"] = content
            if tool_deltas:
                d["tool_calls"] = tool_deltas
            return d, self._tools.num_calls > 0
        if self.mode.kind in ("required", "named"):
            self._text += content
            content = ""
            if final:
                calls = _forced_calls(self.mode, self._text) or []
                if not calls:
                    content = self._text
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = []
            for c in calls:
                d["tool_calls"].append({"index": self._num_calls, **c})
                self._num_calls += 1
        return d, self._num_calls > 0


def _join(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    return a[0] + b[0], a[1] + b[1]


def reasoning_end_ids(tokenizer: Any) -> list[int]:
    """Token ids of ``</think>`` (where a reasoning model's constrained part starts)."""
    return list(tokenizer(END, add_special_tokens=False).input_ids)
