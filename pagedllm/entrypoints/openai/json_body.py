"""Strict JSON for what clients send: request bodies, and JSON strings inside them
(tool-call ``arguments``).

Every request body of every route is parsed by :func:`loads_strict` (pydantic routes
through :class:`StrictJSONRoute`, the raw-body routes directly), which is ``json.loads``
that also refuses, each as a 400 naming where:

* nesting deeper than :data:`MAX_JSON_DEPTH`, found by a bracket scan *before* parsing
  (Python's parser recurses: 100,000 levels raise ``RecursionError``, and whatever deep
  value gets through recurses again later, in templates and encoders);
* ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow to infinity (``1e999``):
  not JSON (RFC 8259), yet Python reads them, and a value holding one cannot be written
  back (every response echoing it was a 500, streamed events carried ``Infinity``);
* strings (values or keys) holding a lone UTF-16 surrogate (``"\\ud800"``): not Unicode
  text, so no response echoing it can be encoded.

:func:`check_depth` is the scan alone, for JSON strings a client embeds in a field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from pagedllm.entrypoints.openai.protocol import _surrogate_path
from pagedllm.entrypoints.openai.request_error import RequestError

# Deeper than any real request (schemas, tool arguments nest a few dozen levels at most),
# far below what Python's recursive parser, encoder and Jinja survive.
MAX_JSON_DEPTH = 128

# A whole JSON string (unrolled loop: fast on long strings), or one bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)
_KEY_END = re.compile(r"\s*:")


def _deep_at(text: str, limit: int) -> tuple[bool, str | None]:
    """(whether ``text`` nests deeper than ``limit``, the top-level key it does so in).
    Brackets inside strings do not count; the scan stops at the first excess."""
    if text.count("[") + text.count("{") <= limit:  # C-speed: no scan needed
        return False, None
    depth, key = 0, None
    for m in _TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c == '"':
            if depth == 1 and _KEY_END.match(text, m.end()):
                key = tok[1:-1]
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True, key
        else:
            depth -= 1
    return False, None


def check_depth(text: str, param: str | None, limit: int = MAX_JSON_DEPTH) -> None:
    """400 naming ``param`` if the JSON ``text`` nests deeper than ``limit`` (a cheap
    scan: call it before ``json.loads`` on any client-supplied JSON string)."""
    if _deep_at(text, limit)[0]:
        raise RequestError(f"{param or 'the JSON value'} nests deeper than {limit} levels",
                           param)


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def _finite_float(s: str) -> float:
    v = float(s)
    if v in (float("inf"), float("-inf")):
        raise _NonFinite(s)
    return v


class _Marker:
    """Stands for a non-finite number while :func:`_non_finite_path` looks for it."""


def _non_finite_path(text: str) -> str | None:
    """The dotted path of the first NaN/Infinity in ``text`` (valid JSON otherwise)."""
    marker = _Marker()

    def mark_float(s: str) -> Any:
        v = float(s)
        return marker if v in (float("inf"), float("-inf")) else v

    stack: list[tuple[str, Any]] = [("", json.loads(text, parse_constant=lambda _: marker,
                                                    parse_float=mark_float))]
    while stack:
        path, v = stack.pop()
        if v is marker:
            return path or None
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
    return None


def loads_strict(data: bytes | str, param: str | None = None,
                 limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(data)``, refusing what the module doc lists; every failure is a
    ``RequestError`` (400) naming the field (below ``param`` when given)."""
    try:
        text = data if isinstance(data, str) else data.decode(json.detect_encoding(data))
    except (UnicodeDecodeError, LookupError):
        raise RequestError("the body is not valid JSON (not UTF-8 text)", param) from None
    where = param or "the body"
    deep, key = _deep_at(text, limit)
    if deep:
        at = ".".join(p for p in (param, key) if p) or None
        raise RequestError(f"{at or where} nests deeper than {limit} levels", at)
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NonFinite:
        sub = _non_finite_path(text)
        at = ".".join(p for p in (param, sub) if p) or None
        raise RequestError(f"{at or where} holds a non-finite number (NaN or Infinity are "
                           "not JSON)", at) from None
    except RecursionError:  # unreachable after the depth scan; kept as a guard
        raise RequestError(f"{where} nests too deeply", param) from None
    except json.JSONDecodeError as e:
        raise RequestError(f"{where} is not valid JSON: {e.msg} at position {e.pos}",
                           param) from None
    except ValueError:  # an integer beyond Python's digit cap (4,300 digits)
        raise RequestError(f"{where} holds a number with too many digits", param) from None
    sub = _surrogate_path(value)
    if sub is not None:
        at = ".".join(p for p in (param, sub) if p)
        raise RequestError(f"{at} contains a lone UTF-16 surrogate (not valid Unicode "
                           "text)", at)
    return value


class BodyError(HTTPException):
    """A refused body inside FastAPI's own body parsing (which turns anything but an
    ``HTTPException`` into a bare "error parsing the body"); carries ``param``."""

    def __init__(self, e: RequestError) -> None:
        super().__init__(status_code=e.status, detail=e.message)
        self.param = e.param


class StrictJSONRequest(Request):
    """A request whose ``json()`` is :func:`loads_strict`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads_strict(await self.body())
            except RequestError as e:
                raise BodyError(e) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """FastAPI's route with :class:`StrictJSONRequest`: pydantic bodies are parsed
    strictly too (set as the app router's ``route_class`` before routes are added)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Any:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
