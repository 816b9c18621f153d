"""JSON grammars allow at most one line break (plus indentation) where optional
whitespace may come, so a small model cannot spend its tokens on blank lines (issue 46
item 17); ``disable_any_whitespace`` allows none; ``json_object`` is any object.
Checked byte by byte on a 257-token byte vocabulary (no model)."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from pagedllm.structured_output.backend import MAX_WHITESPACE, _grammar
from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
          "items": {"type": "string"}}}, "required": ["a", "b"]}
_INFO = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"],
                          vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])


def _accepts(so: SO, text: str) -> bool:
    compiled = xgr.GrammarCompiler(_INFO, max_threads=1,
                                   cache_enabled=False).compile_grammar(_grammar(so))
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(b) for b in text.encode()) and m.accept_token(256)


PRETTY = '{\n  "a": 1,\n  "b": [\n    "x",\n    "y"\n  ]\n}'
COMPACT = '{"a":1,"b":["x","y"]}'
SPACED = '{"a": 1, "b": ["x", "y"]}'


@pytest.mark.parametrize("so", [SO(json=SCHEMA), SO(json_object=True)])
def test_one_line_break_and_indentation_per_position(so: SO) -> None:
    for text in (PRETTY, COMPACT, SPACED, '{\r\n\t"a": 1, "b": []}'):
        assert _accepts(so, text), text
    too_wide = "{" + " " * (MAX_WHITESPACE + 1) + '"a": 1, "b": []}'
    for text in ('{\n\n  "a": 1, "b": []}', '{"a": 1,\n\n"b": []}',
                 '{"a": 1, "b": [\n \n"x"]}', too_wide):
        assert not _accepts(so, text), text


def test_disable_any_whitespace_and_json_object_kinds() -> None:
    # xgrammar's fixed separators then: ", " and ": ", no line breaks.
    assert _accepts(SO(json=SCHEMA, disable_any_whitespace=True), SPACED)
    assert not _accepts(SO(json=SCHEMA, disable_any_whitespace=True), PRETTY)
    assert _accepts(SO(json_object=True), '{"x": {"y": [null, true, 1.5e3]}, "z": "s"}')
    assert not _accepts(SO(json_object=True), "[1, 2]")  # an object, not any JSON value
