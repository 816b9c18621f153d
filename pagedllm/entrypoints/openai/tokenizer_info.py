"""``GET /tokenizer_info``: the served tokenizer's configuration, in vLLM's shape.

Clients that tokenize on the server (lm-evaluation-harness's ``tokenizer_backend=remote``)
read the special tokens and the chat template here and then call ``/tokenize`` and
``/detokenize``.  The body is the tokenizer's ``init_kwargs`` made JSON-safe, plus
``tokenizer_class``, the special tokens as strings, ``model_max_length`` (the server's
``max_model_len``), ``vocab_size`` (``len(tokenizer)``) and ``chat_template`` (the
server's ``--chat-template`` if given, else the model's).  Unlike vLLM
(``--enable-tokenizer-info-endpoint``) it is always served: it tells nothing that
``/tokenize`` and the chat template's effect do not already show, and it needs the API
key like every other route.
"""

from __future__ import annotations

from typing import Any

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _json_safe(value: Any) -> Any:
    """Plain JSON values kept, tokens (``AddedToken``) as their text, the rest dropped."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_json_safe(v) for v in value]
        return [v for v in items if v is not _DROP]
    if isinstance(value, dict):
        out = {str(k): _json_safe(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _DROP}
    content = getattr(value, "content", None)  # tokenizers.AddedToken
    return content if isinstance(content, str) else _DROP


_DROP = object()


def tokenizer_info(tokenizer: Any, chat_template: str | None,
                   max_model_len: int) -> dict[str, Any]:
    """The ``/tokenizer_info`` body for ``tokenizer`` (a transformers tokenizer)."""
    info = _json_safe(dict(getattr(tokenizer, "init_kwargs", None) or {}))
    for name in _SPECIAL:
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) or token is None else str(token)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = max_model_len
    info["vocab_size"] = len(tokenizer)  # ids below it are tokens (load generators use it)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info
