"""The tool-call parsers and their streaming wrapper (see the package docstring)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (``arguments`` as a JSON string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


# The head of a call object as models write it: name first, then the arguments object.
# Arguments are streamed (and returned) as the model's own text of that object only
# when a call starts this way; the lookahead makes the match stable while text is still
# arriving (it needs the object's "{").
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                       r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass
class JsonValueEnd:
    """Finds, incrementally, where a JSON object or array that starts at the first fed
    character closes (strings and escapes respected; validity is not checked: the
    complete call is parsed with ``json`` before it counts)."""

    depth: int = 0
    in_str: bool = False
    esc: bool = False
    seen: int = 0  # characters fed so far

    def feed(self, s: str) -> int:
        """Characters of ``s`` up to and including the closing bracket, or -1."""
        for i, ch in enumerate(s):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.seen += i + 1
                    return i + 1
        self.seen += len(s)
        return -1


def raw_arguments(obj_text: str) -> str | None:
    """The model's own text of a call object's arguments object (``None`` when the call
    does not start with its name and an arguments object)."""
    m = CALL_HEAD.match(obj_text)
    if m is None:
        return None
    end = JsonValueEnd().feed(obj_text[m.end():])
    return None if end < 0 else obj_text[m.end():m.end() + end]


def _object_texts(body: str) -> list[str]:
    """The texts of the top-level JSON objects of a body (a list, one object, or several
    joined by ``;``), assuming it parsed."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        while i < len(body) and body[i] in " \t\r\n,;[]":
            i += 1
        if i >= len(body):
            break
        try:
            _, j = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return []
        out.append(body[i:j])
        i = j
    return out


def use_raw_arguments(body: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` with each one's ``arguments`` set to the model's own text of it where
    that text is available and equal as JSON, so a streamed call's accumulated argument
    fragments equal the non-streamed arguments exactly."""
    texts = _object_texts(body)
    if len(texts) != len(calls):
        return calls
    for c, t in zip(calls, texts):
        raw = raw_arguments(t)
        if raw is not None and json.loads(raw) == json.loads(c["function"]["arguments"]):
            c["function"]["arguments"] = raw
    return calls


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for k in args_keys:
        if k in obj:
            args = obj[k]
            if not isinstance(args, (dict, str)):
                return None
            return tool_call(obj["name"], args)
    return tool_call(obj["name"], {})


class ToolParser:
    """Base: ``start`` begins the tool-call part of an output; with ``end`` set, each
    call is its own ``start ... end`` block (text may sit between), without it the rest
    of the output after ``start`` is the calls."""

    name = ""
    start = ""
    end: str | None = None
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    # Special tokens (e.g. [TOOL_CALLS]) must survive detokenization for this parser.
    needs_special_tokens = False

    def find_start(self, text: str) -> int:
        """Index where the tool calls begin in ``text``, or -1."""
        return text.find(self.start)

    def may_start(self, text: str) -> bool:
        """Whether more text could still make ``text`` begin tool calls at its tail
        (the streaming wrapper holds such a tail back)."""
        tail = text[-len(self.start):] if self.start else ""
        return any(self.start.startswith(tail[i:]) for i in range(len(tail)))

    def parse_body(self, body: str) -> list[dict[str, Any]] | None:
        """The calls in one body (after ``start``, before ``end``), None if malformed."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: model text nested deep
            return None
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(o, self.args_keys) for o in objs]
        if not calls or any(c is None for c in calls):
            return None
        return use_raw_arguments(body, calls)  # type: ignore[arg-type]

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; all content if nothing parses."""
        i = self.find_start(text)
        if i < 0:
            return text, []
        content, rest = text[:i], text[i + len(self.start):]
        calls: list[dict[str, Any]] = []
        if self.end is None:
            parsed = self.parse_body(rest.strip())
            if parsed is None:
                return text, []
            calls = parsed
        else:
            while True:
                j = rest.find(self.end)
                body = rest if j < 0 else rest[:j]
                parsed = self.parse_body(body.strip())
                if parsed is None:
                    return text, []
                calls.extend(parsed)
                if j < 0:
                    break
                rest = rest[j + len(self.end):]
                k = self.find_start(rest)
                if k < 0:
                    if rest.strip():
                        return text, []
                    break
                rest = rest[k + len(self.start):]
        return (content if content.strip() else None), calls


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    def find_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            return len(text) - len(stripped)
        if stripped.startswith("{"):
            return -2  # the whole output is JSON, with no tag
        return -1

    def may_start(self, text: str) -> bool:
        s = text.lstrip()
        return s == "" or self.start.startswith(s)

    def parse_body(self, body: str) -> list[dict[str, Any]] | None:
        calls: list[dict[str, Any]] = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, j = dec.raw_decode(body, i)
            except json.JSONDecodeError:
                return None
            call = _call_of(obj, self.args_keys)
            if call is None:
                return None
            calls.append(call)
            i = j
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return use_raw_arguments(body, calls) if calls else None

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        i = self.find_start(text)
        if i == -1:
            return text, []
        body = text.lstrip()[len(self.start):] if i >= 0 else text
        calls = self.parse_body(body.strip())
        return (text, []) if calls is None else (None, calls)


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}") from None
