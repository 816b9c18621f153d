"""StructuredOutputsParams: what shape the output must take (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
``choice`` (a list of literal strings), ``grammar`` (EBNF, xgrammar's dialect; GBNF
grammars from llama.cpp parse too) or ``json_object`` (any JSON object) is set.
Torch-free and xgrammar-free: it travels inside ``SamplingParams`` to the engine core
(msgspec encodes it as a plain struct); the grammar library is only touched by
``structured_output.backend`` (validation in the frontend, compilation in the core).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint.  ``ValueError`` (naming ``structured_outputs``) when none
    or several kinds are set, or a kind has the wrong type.

    ``disable_any_whitespace``: JSON without optional whitespace (more compact, and a
    small model cannot wander off into endless spaces).
    ``reasoning_end_token_ids`` is set by the server, not the user: with a reasoning
    parser the constraint starts only after this token sequence (e.g. ``</think>``)
    appears in the output.
    ``origin`` is set by the server too: the request field the constraint came from
    (``response_format``, ``tools``, ...), which its errors name; not part of the
    grammar's identity.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_end_token_ids: list[int] | None = None
    origin: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        # Strict types (no 1/"true" for a boolean): the engine core decodes these fields
        # typed (msgspec), so a value that passes here must pass there too.
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if not isinstance(self.origin, str):
            raise ValueError("structured_outputs.origin must be a string")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        ids = self.reasoning_end_token_ids
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63
                for i in ids)):
            raise ValueError("structured_outputs.reasoning_end_token_ids must be a list "
                             "of token ids")
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(set_kinds) or 'none'})")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or "
                             "string)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable identity of the grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else _json.dumps(
                self.json, sort_keys=True)
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return (kind + (":compact" if self.disable_any_whitespace else ""), spec)


def coerce(value: object) -> StructuredOutputsParams | None:
    """``StructuredOutputsParams`` from itself, a dict of its fields (what
    ``dataclasses.asdict`` and JSON give), or ``None``."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s): {', '.join(unknown)}")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                     f"{type(value).__name__}")
