"""OpenAI error envelopes and the FastAPI exception handlers that produce them.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape).
Messages never carry stack traces, object reprs or file paths: unexpected exceptions are
logged server-side and answered with a generic 500.

Choices (RELIABILITY.md): FastAPI answers schema failures with 422; OpenAI clients and
this project expect 400, so ``RequestValidationError`` (malformed JSON, a JSON array,
a wrong type) becomes 400 with ``param`` set to the offending field.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.protocol import RequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


def error_body(message: str, *, status: int = 400, err_type: str | None = None,
               param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message,
                      "type": err_type or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(message: str, *, status: int = 400, err_type: str | None = None,
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status=status, err_type=err_type, param=param,
                                   code=code), status_code=status, headers=headers)


def request_error_response(e: RequestError) -> JSONResponse:
    return error_response(e.message, status=e.status, err_type=e.err_type, param=e.param,
                          code=e.code, headers=e.headers)


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``; the body root -> None."""
    parts = [str(p) for p in loc if p != "body"]
    # Union members appear in loc as type names ("str", "list[int]"); keep the field path.
    parts = [p for p in parts if not (p.startswith(("list[", "dict[")) or p in (
        "str", "int", "float", "bool", "function-before[_number(), float]"))]
    return ".".join(parts) or None


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response("invalid request body")
    first = errors[0]
    etype = first.get("type", "")
    if etype == "json_invalid":
        return error_response("request body is not valid JSON", param=None)
    if etype == "unpaired_surrogate":  # raised on the whole body; ctx names the field
        param = str((first.get("ctx") or {}).get("param") or "body")
        return error_response(str(first.get("msg")), param=param)
    param = _loc_param(tuple(first.get("loc", ())))
    if param is None:
        if etype == "missing":
            return error_response("request body is required")
        return error_response("request body must be a JSON object")
    if etype == "missing":
        return error_response(f"{param} is required", param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return error_response(f"{param}: {msg}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers turning every failure into the OpenAI envelope."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return request_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else None
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        # FastAPI's "There was an error parsing the body" is a client error in our terms.
        return error_response(detail or phrase, status=status,
                              param=getattr(exc, "param", None),  # json_body.BodyError
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response("internal server error", status=500, err_type="server_error")
