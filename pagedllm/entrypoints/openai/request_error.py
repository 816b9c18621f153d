"""``RequestError``: a client error found after schema validation.

Below the request models (``protocol.py``) and the field mappers they call
(``structured.py``), which both raise it; ``errors.py`` turns it into an HTTP 4xx
envelope.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A client error found after schema validation: becomes an HTTP 4xx envelope."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, err_type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.err_type = err_type
