"""Tools for a model whose chat template has no tool support: the prompt and the grammar.

When the server's tool support is the *prompt fallback* (``tool_detection.py``), the
request's tools are not handed to the template (it would drop them); instead:

1. :func:`fallback_messages` puts a readable instruction into the system message
   (:func:`system_prompt`): the tools as JSON, one per line, and the call format
   (hermes, as Qwen 2.5 and Hermes models write it)::

       <tool_call>
       {"name": "get_weather", "arguments": {"city": "Paris"}}
       </tool_call>

   Earlier assistant calls are written back in that format and ``tool`` results become
   user turns in ``<tool_response>`` blocks, so a multi-turn exchange reads consistently
   whatever roles the template knows.
2. :func:`call_grammar` builds an xgrammar *structural tag* as EBNF text (a ``grammar``
   constraint; it travels and compiles like any other): the model writes free text until
   it emits the trigger ``<tool_call>``; from there the tag's grammar fixes the call's
   envelope and the arguments follow the tool's ``parameters`` schema (compact JSON).
   ``tool_choice`` ``"required"`` and a named function use the same grammar forced from
   the first token (a named one: that tool only, one call).
3. The output is read by the ``hermes`` tool parser, so the response carries
   ``tool_calls`` as usual (streamed ones included).
"""

from __future__ import annotations

import json
from typing import Any

TRIGGER = "<tool_call>"
END = "</tool_call>"

_INSTRUCTIONS = (
    "You can call functions. The functions, one JSON object per line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with only this, once per call:\n"
    "<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments object>}}\n'
    "</tool_call>\n"
    "If no function fits, answer the user directly.")


def _tool_line(fn: dict[str, Any]) -> str:
    entry: dict[str, Any] = {"name": fn["name"]}
    if isinstance(fn.get("description"), str):
        entry["description"] = fn["description"]
    entry["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return json.dumps(entry, ensure_ascii=False)


def system_prompt(fns: list[dict[str, Any]]) -> str:
    """The instruction text for the ``function`` objects ``fns`` (see the module doc)."""
    return _INSTRUCTIONS.format(tools="\n".join(_tool_line(f) for f in fns))


def _call_text(call: Any) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return ""
    args = fn.get("arguments")
    if isinstance(args, str):  # JSON text (template_messages decodes what parses)
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{TRIGGER}\n{body}\n{END}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: their text joined
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else str(content)


def fallback_messages(messages: list[dict[str, Any]], fns: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """``messages`` with the tool instruction in the system message (prepended to the
    client's own, or a new first message), assistant ``tool_calls`` as ``<tool_call>``
    text and ``tool`` messages as user ``<tool_response>`` turns.  With no ``fns`` only
    the history is rewritten (``tool_choice: "none"``)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            text = "\n".join([_text(m.get("content"))] + calls).strip()
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content":
                        f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"})
        else:
            out.append(m)
    if fns:
        sys_text = system_prompt(fns)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"),
                                                                 str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    return out


def call_grammar(fns: list[dict[str, Any]], forced: bool, single: bool) -> str:
    """The structural tag for calls of ``fns``, as EBNF: free text until ``<tool_call>``
    (unless ``forced``: a call first), then one of the tools' envelopes with its
    arguments schema; after a call only more calls (one per line) or the end, or just
    the end when ``single`` -- so the hermes parser reads the whole output.  Raises
    ``ValueError`` (xgrammar's message) when a schema cannot become a grammar."""
    import xgrammar as xgr

    tags = []
    for fn in fns:
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        args = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                strict_mode=True))
        head = json.dumps(fn["name"], ensure_ascii=False)
        tags.append({"begin": f'{TRIGGER}\n{{"name": {head}, "arguments": ',
                     "content": {"type": "grammar", "grammar": args},
                     "end": f"}}\n{END}"})
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
             "at_least_one": forced, "stop_after_first": single}
    if forced:
        fmt: dict[str, Any] = calls
    else:  # text, then (once triggered) calls to the end: nothing may follow a call
        fmt = {"type": "sequence", "elements": [
            {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags,
             "at_least_one": False, "stop_after_first": True},
            *([] if single else [{**calls, "at_least_one": False}])]}
    tag = {"type": "structural_tag", "format": fmt}
    try:
        return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except Exception as e:  # xgrammar's own error types
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
