"""Streaming tool calls: text deltas in, content deltas and OpenAI tool-call deltas out.

:class:`ToolCallStream` passes content through as it comes, except a tail that may be
the start of a tool call (held back).  Once tool calls begin, what it sends depends on
``incremental``:

* ``incremental=True`` (chat completions, OpenAI's shape): as soon as a call's name and
  the ``{`` of its arguments have arrived, a first delta carries ``index``, ``id``,
  ``type`` and ``function.name`` (with ``arguments: ""``); later deltas carry
  ``function.arguments`` fragments, the model's own text of the arguments object, as it
  is produced.  Accumulated, they equal the non-streamed ``arguments`` exactly (both are
  the model's text of the object; :func:`parsers.use_raw_arguments`).  A call written
  another way (arguments first, a string of JSON) is sent whole when it is complete.
* ``incremental=False`` (the Messages and Responses adapters): each call is sent whole,
  in one delta, when it is complete.

Malformed output: a call body that does not parse when it ends is released as content.
With ``incremental``, a call whose head was already sent cannot be taken back; it keeps
the argument text sent so far and the unsent rest of its body comes as content (the
same as a call cut short by ``max_tokens``).  Output malformed before a head was sent
falls back wholly to text, as it does without streaming.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.parsers import (
    CALL_HEAD,
    JsonValueEnd,
    Llama3JsonToolParser,
    ToolParser,
)

# Text that may sit between the calls of one body (a JSON list, ``;``-joined objects)
# and after a call's arguments (its closing brace).
_BETWEEN = " \t\r\n,;[]}"
# A head not found within this many characters of an object's start is not looked for.
_MAX_HEAD = 4096


@dataclass
class _Open:
    """A call whose head was sent: where its arguments start in the body, how many of
    their characters were sent, and the scanner finding their end."""

    index: int
    args_start: int
    sent: int = 0
    scan: JsonValueEnd = field(default_factory=JsonValueEnd)
    closed: bool = False


@dataclass
class ToolCallStream:
    """Feed text deltas; get ``(content delta, tool-call deltas)``.  Each tool-call delta
    is a dict with ``index`` (the call's position in the choice) and the OpenAI fields."""

    parser: ToolParser
    incremental: bool = False
    text: str = ""
    sent: int = 0  # chars of ``text`` already emitted as content or consumed by calls
    in_call: bool = False
    num_calls: int = 0
    # The current body's streamed calls, where to look for the next head, and whether
    # the body has stopped being streamable (then its calls are sent whole at the end).
    _open: list[_Open] = field(default_factory=list)
    _next: int = 0
    _whole: bool = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        p = self.parser
        content, deltas = "", []
        while True:
            pending = self.text[self.sent:]
            if not self.in_call:
                i = p.find_start(pending) if (self.sent == 0 or p.end is not None) else -1
                if isinstance(p, Llama3JsonToolParser) and self.sent > 0:
                    i = -1
                if i == -2 or i >= 0:
                    cut = max(i, 0)
                    if not (self.num_calls and not pending[:cut].strip()):
                        content += pending[:cut]  # (blank lines between calls dropped)
                    self.sent += cut
                    self.in_call = True
                    continue
                if self.num_calls and not pending.strip():  # blank text after a call
                    if final:
                        self.sent += len(pending)
                    return content, deltas
                if not final and p.may_start(pending):
                    keep = self._held_back(pending)
                    if self.num_calls and not pending[:len(pending) - keep].strip():
                        return content, deltas  # maybe blank lines before a call
                    content += pending[:len(pending) - keep]
                    self.sent += len(pending) - keep
                else:
                    content += pending
                    self.sent += len(pending)
                return content, deltas
            # inside a call: stream what is there, and parse it when it ends
            lead = 0
            if pending.lstrip().startswith(p.start):
                lead = len(pending) - len(pending.lstrip()) + len(p.start)
            body_start = pending[lead:]
            j = body_start.find(p.end) if p.end else -1
            body = body_start if j < 0 else body_start[:j]
            if self.incremental:
                deltas += self._partial(body)
            if j < 0 and not final:
                return content, deltas
            consumed = len(pending) if j < 0 else lead + j + len(p.end or "")
            parsed = p.parse_body(body.strip())
            if parsed is None:  # malformed: text after all (less what was streamed)
                flushed = max((o.args_start + o.sent for o in self._open), default=-1)
                content += pending[:consumed] if flushed < 0 else body[flushed:]
            else:
                deltas += self._complete(parsed)
            self.sent += consumed
            self.in_call = False
            self._open, self._next, self._whole = [], 0, False
            if j < 0:
                return content, deltas

    def _head(self, call: dict[str, Any]) -> dict[str, Any]:
        d = {"index": self.num_calls, **call}
        self.num_calls += 1
        return d

    def _partial(self, body: str) -> list[dict[str, Any]]:
        """Deltas for the calls of ``body`` (a prefix of the current call body) that
        became visible since the last call: heads, then argument fragments."""
        out: list[dict[str, Any]] = []
        while not self._whole:
            cur = self._open[-1] if self._open and not self._open[-1].closed else None
            if cur is None:
                k = self._next
                while k < len(body) and body[k] in _BETWEEN:
                    k += 1
                if k == len(body):
                    return out
                m = CALL_HEAD.match(body, k) if body[k] == "{" else None
                if m is None:
                    # Wait for more text unless it cannot be a head of our shape: not
                    # an object, or its arguments object already began.
                    if body[k] != "{" or "{" in body[k + 1:] or len(body) - k > _MAX_HEAD:
                        self._whole = True
                    return out
                name = json.loads(f'"{m.group(1)}"')
                self._open.append(_Open(self.num_calls, m.end()))
                out.append(self._head({
                    "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": name, "arguments": ""}}))
                continue
            start = cur.args_start + cur.scan.seen
            closed = cur.scan.feed(body[start:]) >= 0
            upto = cur.scan.seen
            if upto > cur.sent:
                out.append({"index": cur.index, "function": {
                    "arguments": body[cur.args_start + cur.sent:cur.args_start + upto]}})
                cur.sent = upto
            if not closed:
                return out
            cur.closed = True
            self._next = cur.args_start + upto
        return out

    def _complete(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas that finish a parsed body: the unsent argument text of calls
        already streamed, and the others whole."""
        out = []
        for k, c in enumerate(calls):
            if k >= len(self._open):
                out.append(self._head(c))
                continue
            o = self._open[k]
            rest = c["function"]["arguments"][o.sent:]
            if rest:
                out.append({"index": o.index, "function": {"arguments": rest}})
        return out

    def _held_back(self, pending: str) -> int:
        p = self.parser
        if isinstance(p, Llama3JsonToolParser):
            return len(pending)
        for k in range(min(len(p.start), len(pending)), 0, -1):
            if p.start.startswith(pending[-k:]):
                return k
        return 0
