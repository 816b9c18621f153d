"""Request bodies of the pooling endpoints (OpenAI's embeddings; vLLM's score, rerank and
pooling; Cohere's rerank).  Unknown fields are kept (``extra="allow"``) so that the
server names them in a 400 unless ``--allow-unknown-fields``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedllm.entrypoints.openai.protocol import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(_Body):
    """``input``: a string, a list of strings, a list of token ids, or a list of such
    lists (OpenAI); ``normalize`` is vLLM's extra (None: the model's default)."""

    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[Any]:
        x = self.input
        if isinstance(x, str):
            return [x] if x else _bad_input()
        if not isinstance(x, list) or not x:
            return _bad_input()
        if all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            return [{"prompt_token_ids": x}]
        out: list[Any] = []
        for item in x:
            if isinstance(item, str) and item:
                out.append(item)
            elif isinstance(item, list) and item and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in item):
                out.append({"prompt_token_ids": item})
            else:
                return _bad_input()
        return out


def _bad_input() -> list[Any]:
    raise RequestError("input must be a non-empty string, a list of strings, a list of "
                       "token ids, or a list of token id lists", "input")


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling``: the raw pooled vectors (task ``encode``)."""


class ScoreRequest(_Body):
    """vLLM's ``/score``: ``text_1`` (one text, or one per ``text_2``) against
    ``text_2``."""

    text_1: Any = None
    text_2: Any = None


class RerankRequest(_Body):
    """vLLM's and Cohere's ``/rerank``: ``documents`` as strings or ``{"text": ...}``;
    ``top_n`` 0 or None: all of them."""

    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool = True

    def texts(self) -> list[str]:
        if not isinstance(self.query, str) or not self.query:
            raise RequestError("query must be a non-empty string", "query")
        docs = self.documents
        if not isinstance(docs, list) or not docs:
            raise RequestError("documents must be a non-empty list", "documents")
        out = []
        for d in docs:
            if isinstance(d, dict) and isinstance(d.get("text"), str):
                d = d["text"]
            if not isinstance(d, str) or not d:
                raise RequestError("documents must hold non-empty strings or "
                                   "{\"text\": ...} objects", "documents")
            out.append(d)
        if self.top_n is not None and self.top_n < 0:
            raise RequestError("top_n must be >= 0", "top_n")
        return out
