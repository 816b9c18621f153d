"""The tool-call parsers and their streaming wrapper (see the package docstring)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (``arguments`` as a JSON string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


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
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(o, self.args_keys) for o in objs]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]

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
        return calls or None

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


@dataclass
class ToolCallStream:
    """Streaming: feed text deltas, get content deltas and complete tool calls.

    Content is passed through as it comes, except a tail that may be the start of a
    tool call, which is held back; once tool calls begin, text is buffered and parsed
    when a call ends (``end`` marker) or at the end of the output.  Each call is emitted
    whole, in one delta (OpenAI's clients accumulate either way).  If the buffer does
    not parse, it is released as content.
    """

    parser: ToolParser
    text: str = ""
    sent: int = 0  # chars of ``text`` already emitted as content or consumed by calls
    in_call: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        p = self.parser
        content, new_calls = "", []
        while True:
            pending = self.text[self.sent:]
            if not self.in_call:
                i = p.find_start(pending) if (self.sent == 0 or p.end is not None) else -1
                if isinstance(p, Llama3JsonToolParser) and self.sent > 0:
                    i = -1
                if i == -2 or i >= 0:
                    cut = max(i, 0)
                    if not (self.calls and not pending[:cut].strip()):
                        content += pending[:cut]  # (blank lines between calls dropped)
                    self.sent += cut
                    self.in_call = True
                    continue
                if self.calls and not pending.strip():  # blank text after a call
                    if final:
                        self.sent += len(pending)
                    return content, new_calls
                if not final and p.may_start(pending):
                    keep = self._held_back(pending)
                    if self.calls and not pending[:len(pending) - keep].strip():
                        return content, new_calls  # maybe blank lines before a call
                    content += pending[:len(pending) - keep]
                    self.sent += len(pending) - keep
                else:
                    content += pending
                    self.sent += len(pending)
                return content, new_calls
            # inside a call: wait for its end (or the output's end)
            body_start = pending
            if body_start.lstrip().startswith(p.start):
                body_start = body_start.lstrip()[len(p.start):]
            j = body_start.find(p.end) if p.end else -1
            if j < 0 and not final:
                return content, new_calls
            body = body_start if j < 0 else body_start[:j]
            parsed = p.parse_body(body.strip())
            if parsed is None:  # malformed: it was text after all
                content += pending
                self.sent += len(pending)
                self.in_call = False
                return content, new_calls
            new_calls.extend(parsed)
            self.calls.extend(parsed)
            consumed = len(pending) if j < 0 else (
                len(pending) - len(body_start) + j + len(p.end or ""))
            self.sent += consumed
            self.in_call = False
            if j < 0:
                return content, new_calls

    def _held_back(self, pending: str) -> int:
        p = self.parser
        if isinstance(p, Llama3JsonToolParser):
            return len(pending)
        for k in range(min(len(p.start), len(pending)), 0, -1):
            if p.start.startswith(pending[-k:]):
                return k
        return 0
