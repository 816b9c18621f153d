"""How this server reads tool calls: decided once at start-up from the flags, the chat
template and the model's config.

* ``--tool-call-parser NAME`` (with or without ``--enable-auto-tool-choice``): exactly
  that, as in vLLM -- ``tool_choice: "auto"`` only with ``--enable-auto-tool-choice``,
  the template renders the tools itself, no prompt fallback.
* ``--tool-call-parser none``: tools off as vLLM has them without flags -- ``"auto"``
  refused, ``"required"`` and named functions grammar-forced as JSON.
* Otherwise (the default, and ``--enable-auto-tool-choice`` alone) the parser is
  *detected*: a template that uses ``tools`` and writes ``<tool_call>`` is ``hermes``
  (Qwen 2.5/3, Hermes), ``[TOOL_CALLS]`` is ``mistral``, ``<|python_tag|>`` or a Llama
  3 header with ``tools`` is ``llama3_json``; ``"auto"`` is then on.  A template without
  tool support (or one whose format none of the parsers reads) gets the *prompt
  fallback* (``tool_prompt.py``): the tools go into the system prompt in hermes format,
  a structural-tag grammar guides the call once the model opens one, and the ``hermes``
  parser reads it.

:func:`resolve` returns the decision as a :class:`ToolSupport`; its ``summary`` is the
start-up log line.
"""

from __future__ import annotations

from dataclasses import dataclass

DETECT = None  # --tool-call-parser not given
OFF = "none"


@dataclass(frozen=True)
class ToolSupport:
    """``parser``: the tool parser reading ``"auto"`` output (None: auto refused);
    ``auto``: ``tool_choice: "auto"`` accepted; ``prompt_fallback``: the server renders
    the tools into the system prompt and constrains calls with a grammar (every tool
    choice); ``summary``: one line saying what was decided and why."""

    parser: str | None
    auto: bool
    prompt_fallback: bool
    summary: str


def template_uses_tools(template: str | None) -> bool:
    """Whether the Jinja ``template`` reads a ``tools`` variable (False when it does not
    parse or there is none)."""
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)


def detect_parser(template: str | None, model_type: str | None = None) -> str | None:
    """The tool parser that reads what ``template`` (one using ``tools``) asks the model
    to write; ``model_type`` (the config's) breaks ties.  None: no parser fits."""
    if not template_uses_tools(template):
        return None
    assert template is not None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return "hermes"
    if model_type == "mistral":
        return "mistral"
    return None


def resolve(flag_parser: str | None, enable_auto: bool, template: str | None,
            model_type: str | None = None) -> ToolSupport:
    """The server's tool support from ``--tool-call-parser`` (``flag_parser``: a name,
    ``"none"`` or None), ``--enable-auto-tool-choice`` and the effective chat template."""
    if flag_parser == OFF:
        return ToolSupport(None, False, False, "tool calling: off (--tool-call-parser "
                           'none): tool_choice "auto" is refused')
    if flag_parser is not DETECT:
        how = ('tool_choice "auto" on' if enable_auto
               else 'tool_choice "auto" off (no --enable-auto-tool-choice)')
        return ToolSupport(flag_parser, enable_auto, False,
                           f"tool calling: parser {flag_parser} (--tool-call-parser), {how}")
    found = detect_parser(template, model_type)
    if found is not None:
        return ToolSupport(found, True, False,
                           f"tool calling: parser {found} detected from the chat template; "
                           'tool_choice "auto" on (--tool-call-parser none turns it off)')
    why = ("uses tools in a format no parser reads" if template_uses_tools(template)
           else "has no tool support")
    return ToolSupport("hermes", True, True,
                       f"tool calling: the chat template {why}; tools go into the system "
                       "prompt (hermes <tool_call> format, grammar-guided calls); "
                       'tool_choice "auto" on (--tool-call-parser none turns it off)')
