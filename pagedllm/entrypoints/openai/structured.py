"""The request fields that constrain the output, mapped to ``StructuredOutputsParams``.

Accepted spellings (at most one of the three families per request, else a 400 naming
the second):

* OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}``;
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace": bool}``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` (one of them).

Each constraint's size is bounded here (``structured_output.limits``) and it is then
parsed, checked and test-compiled off the event loop in the server's grammar-check
workers (``checked``, from ``ServingState.start``), so an invalid schema, regex or
grammar, or one over a limit, is a 400 naming the field it came from (``origin``); the
engine never sees it.  ``strict`` is accepted either way: the grammar always enforces the schema.
"""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.request_error import RequestError
from pagedllm.structured_outputs_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}


def _make(field: str, **kw: Any) -> StructuredOutputsParams:
    try:
        so = StructuredOutputsParams(**kw, origin=field)
    except (TypeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        # Name the sub-field when the message does (``structured_outputs.json_object``).
        named = re.match(r"structured_outputs(\.\w+)", msg)
        if field == "structured_outputs" and named:
            raise RequestError(msg, named.group(0)) from None
        raise RequestError(f"{field}: {msg}", field) from None
    check_size(so)
    return so


def check_size(so: StructuredOutputsParams) -> None:
    """The constraint's up-front size bounds (``structured_output.limits``; linear,
    on the event loop), a 400 naming ``so.origin`` and the limit.  Parsing and
    compiling happen later, in the server's grammar-check workers (``checked``)."""
    from pagedllm.structured_output.limits import check_limits

    try:
        check_limits(so, so.origin)
    except ValueError as e:
        raise RequestError(str(e).splitlines()[0], so.origin) from None


async def checked(checker: Any, so: StructuredOutputsParams,
                  gone: Any = None) -> None:
    """Parse, check and test-compile ``so`` in ``checker`` (a
    ``structured_output.checker.GrammarChecker``: worker processes, a time and size
    budget): a 400 naming ``so.origin`` when it is invalid or over a limit, a 499 when
    the client left meanwhile (``gone``: an async callable)."""
    from pagedllm.structured_output.checker import CheckAbandoned, GrammarCheckError

    try:
        await checker.check(so, so.origin, gone)
    except GrammarCheckError as e:
        raise RequestError(str(e).splitlines()[0], so.origin) from None
    except CheckAbandoned:
        raise RequestError("the client disconnected", status=499) from None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema must be an object with a "
                               "'schema'", "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
            return _make("response_format", json_object=True)
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be an object",
                               "response_format")
        return _make("response_format", json=schema)
    raise RequestError(f"response_format type {kind!r} is not supported (text, "
                       "json_object or json_schema)", "response_format")


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The request's output constraint (``None``: unconstrained), or a 400."""
    found: list[tuple[str, StructuredOutputsParams | None]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        found.append(("response_format", _from_response_format(rf)))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("structured_outputs must be an object", "structured_outputs")
        internal = sorted({"reasoning_end_token_ids", "origin"} & set(so))
        unknown = sorted(set(so) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown or internal:
            raise RequestError("structured_outputs has unknown field(s): "
                               f"{', '.join(unknown or internal)}",
                               "structured_outputs")
        found.append(("structured_outputs", _make("structured_outputs", **so)))
    guided = [(f, getattr(body, f, None)) for f in GUIDED_FIELDS]
    guided = [(f, v) for f, v in guided if v is not None]
    if len(guided) > 1:
        raise RequestError(f"only one of {', '.join(GUIDED_FIELDS)} may be set",
                           guided[1][0])
    if guided:
        f, v = guided[0]
        if f == "guided_json" and not isinstance(v, (dict, str)):
            raise RequestError("guided_json must be a JSON schema", f)
        found.append((f, _make(f, **{GUIDED_FIELDS[f]: v})))
    if len(found) > 1:
        raise RequestError(f"{found[0][0]} and {found[1][0]} cannot both be set",
                           found[1][0])
    return found[0][1] if found else None
