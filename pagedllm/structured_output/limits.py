"""Up-front bounds on a constraint's size, checked before any grammar library sees it.

xgrammar's costs grow faster than the input: a JSON schema of arrays nested 300 deep
takes 1.7 s to *parse* (900 deep: over a minute), an enum of 20,000 strings 1.9 s and
62 MB to compile against a 49k vocabulary (50,000: ~10 s and ~160 MB), and deeply
nested brackets recurse in C++.  These checks are plain Python, linear in the input and
iterative (no recursion), so a hostile constraint costs microseconds per kilobyte here
and is a ``ValueError`` naming the limit (400 at the API) instead of minutes of CPU.

The limits are generous for real schemas (OpenAI's structured outputs allow 5 levels
of nesting and 500 object properties; tool schemas are far smaller):

==========================  =========  ==============================================
limit                       value      counts
==========================  =========  ==============================================
``MAX_NESTING_DEPTH``       64         JSON-schema containers (objects, arrays) along
                                       one path; brackets ``( [ {`` in a regex or EBNF
``MAX_SCHEMA_NODES``        10,000     every value in the schema document (enum and
                                       const members included); choices
``MAX_GRAMMAR_RULES``       1,000      ``name ::= ...`` rules of an EBNF grammar
``MAX_CONSTRAINT_CHARS``    256 KiB    the text of a regex, grammar, schema or choices
==========================  =========  ==============================================

What they cannot bound (a short regex with nested counted repetition, say) is bounded
by the time and size budget of the compile itself (``checker.py``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.structured_outputs_params import StructuredOutputsParams

MAX_NESTING_DEPTH = 64
MAX_SCHEMA_NODES = 10_000
MAX_GRAMMAR_RULES = 1_000
MAX_CONSTRAINT_CHARS = 256 * 1024

_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)
_OPEN = frozenset("([{")
_CLOSE = frozenset(")]}")


class ConstraintTooLarge(ValueError):
    """A constraint over one of the limits above; the message names it."""


def _schema_bounds(schema: Any, field: str) -> None:
    """Depth (containers along one path) and node count of a decoded JSON document."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ConstraintTooLarge(
                f"{field}: the schema holds more values (enum members included) than "
                f"the limit of {MAX_SCHEMA_NODES}")
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_NESTING_DEPTH:
            raise ConstraintTooLarge(
                f"{field}: the schema nests deeper than the limit of "
                f"{MAX_NESTING_DEPTH} levels")
        stack.extend((c, depth + 1) for c in children)


def _bracket_depth(text: str) -> int:
    """Deepest bracket nesting in ``text`` (an over-estimate inside quoted literals and
    character classes, which only makes the bound stricter)."""
    depth = deepest = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
    return deepest


def _text_bounds(text: str, what: str, field: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintTooLarge(
            f"{field}: the {what} is {len(text)} characters long; the limit is "
            f"{MAX_CONSTRAINT_CHARS}")
    if _bracket_depth(text) > MAX_NESTING_DEPTH:
        raise ConstraintTooLarge(
            f"{field}: the {what} nests brackets deeper than the limit of "
            f"{MAX_NESTING_DEPTH} levels")


def check_limits(p: StructuredOutputsParams, field: str = "structured_outputs") -> None:
    """``ConstraintTooLarge`` (a ``ValueError`` whose message starts with ``field`` and
    names the limit) when ``p`` exceeds a bound of this module; cheap and linear."""
    kind = p.kind
    if kind == "json":
        schema = p.json
        if isinstance(schema, str):
            _text_bounds(schema, "schema", field)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return  # not JSON: the parser's own error names it
        _schema_bounds(schema, field)
    elif kind == "regex":
        assert p.regex is not None
        _text_bounds(p.regex, "regex", field)
    elif kind == "grammar":
        assert p.grammar is not None
        _text_bounds(p.grammar, "grammar", field)
        rules = len(_RULE.findall(p.grammar))
        if rules > MAX_GRAMMAR_RULES:
            raise ConstraintTooLarge(
                f"{field}: the grammar has {rules} rules; the limit is "
                f"{MAX_GRAMMAR_RULES}")
    elif kind == "choice":
        assert p.choice is not None
        if len(p.choice) > MAX_SCHEMA_NODES:
            raise ConstraintTooLarge(
                f"{field}: {len(p.choice)} choices; the limit is {MAX_SCHEMA_NODES}")
        total = sum(len(c) for c in p.choice)
        if total > MAX_CONSTRAINT_CHARS:
            raise ConstraintTooLarge(
                f"{field}: the choices hold {total} characters; the limit is "
                f"{MAX_CONSTRAINT_CHARS}")
