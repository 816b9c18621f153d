"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``).

Each parser turns a model's raw output into ``(content, tool_calls)``, whole
(:meth:`ToolParser.extract`) or while streaming (:class:`ToolCallStream`, with
OpenAI's incremental argument deltas).  Output
that does not parse is returned as plain content: a malformed tool call is never an
error.  Formats:

* ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text allowed before;
* ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several joined by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
"""

from pagedllm.entrypoints.openai.tool_parsers.parsers import (
    TOOL_PARSERS,
    ToolParser,
    get_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.streaming import ToolCallStream

__all__ = ["TOOL_PARSERS", "ToolCallStream", "ToolParser", "get_tool_parser"]
