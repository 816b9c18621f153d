"""Reasoning parsers (``--reasoning-parser qwen3|deepseek_r1``): split a model's
``<think> ... </think>`` reasoning from its answer, whole or while streaming.

* ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output
  starts inside the reasoning (a leading ``<think>`` is tolerated); without
  ``</think>`` the whole output is reasoning (it was cut off while thinking);
* ``qwen3``: reasoning only when the output (or the template) opened ``<think>``;
  an output with neither marker is all content (thinking switched off).

``reasoning_content`` never contains the markers and ``content`` never contains the
reasoning.  With structured outputs the grammar starts after ``</think>`` (the server
puts its token ids in ``StructuredOutputsParams.reasoning_end_token_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    # Whether the output starts inside the reasoning when it has no <think> of its own.
    starts_in_reasoning = True

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output."""
        body = text
        opened = self.starts_in_reasoning
        if body.lstrip().startswith(START):
            body = body.lstrip()[len(START):]
            opened = True
        i = body.find(END)
        if i < 0:
            return (body or None, None) if opened else (None, text)
        content = body[i + len(END):]
        return body[:i] or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if END in text and not text.lstrip().startswith(START):
            # Qwen3's template may open <think> in the prompt: text before </think> is
            # reasoning then.
            i = text.find(END)
            return text[:i] or None, text[i + len(END):] or None
        return super().extract(text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}") from None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningStream:
    """Streaming split: ``feed`` returns (reasoning delta, content delta).

    A tail that may be the beginning of a marker is held back until it resolves.
    For qwen3 an output that begins without ``<think>`` is content unless a ``</think>``
    shows up later; text streamed before that has already gone out as content (as in
    vLLM, an unmarked output is taken as the answer)."""

    parser: ReasoningParser
    buf: str = ""
    state: str = "start"  # start -> reasoning -> content
    seen: str = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(START):
                    self.buf, self.state = s[len(START):], "reasoning"
                    continue
                if not final and START.startswith(s):
                    return reasoning, content  # still undecided
                self.state = "reasoning" if self.parser.starts_in_reasoning else "content"
                continue
            if self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(END):], "content"
                    continue
                keep = 0 if final else _partial_tail(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
