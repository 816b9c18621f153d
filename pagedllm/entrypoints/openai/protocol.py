"""Pydantic models of the OpenAI-compatible HTTP API (requests and responses).

Contract:

* Every field of OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` request bodies
  is *accepted*.  Fields that change nothing here (``user``, ``store``, ``metadata`` ...)
  are ignored; fields we do not implement yet (``functions``, ``audio``, ``suffix``
  ...) are refused with a 400 saying so (``RequestError``).
* vLLM's documented extra sampling fields are accepted (``VLLM_EXTRAS``).
* Anything else lands in ``model_extra`` (models use ``extra="allow"``) and the server
  refuses it with a 400 naming the fields unless ``--allow-unknown-fields`` is set: vLLM
  silently ignored removed parameters and returned unconstrained output (issue #53975).
* Range checks follow the OpenAI reference (temperature in [0, 2], ...); the remaining
  checks are ``SamplingParams``' own, whose ``ValueError`` names the parameter.
"""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.entrypoints.openai.request_error import RequestError
from pagedllm.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- field types


def _number(v: object) -> object:
    """Accept JSON numbers only: no booleans, no numeric strings (``"inf"``), no NaN/inf."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    if math.isnan(v) or math.isinf(v):
        raise ValueError("must be a finite number")
    return v


# JSON integers are unbounded; every integer field is held to int64 (what vLLM accepts for
# ``seed``, and what torch, msgspec and the engine can carry) so no value overflows later.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
# No "yes"/"true"/1 for booleans: the rest of the API is strict about types too.
Bool = Annotated[bool, Strict()]
Num = Annotated[float, BeforeValidator(_number)]
Temperature = Annotated[Num, Field(ge=0.0, le=2.0)]
TopP = Annotated[Num, Field(gt=0.0, le=1.0)]
Penalty = Annotated[Num, Field(ge=-2.0, le=2.0)]
MAX_STOP_SEQUENCES = 32


def _tool_choice(v: object) -> object:
    """OpenAI's chat ``tool_choice`` shapes only: a mode string or a named function
    (``"function"`` a string or a list, or a Responses-only type, was a 500 later)."""
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        fn = v.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            return v
    raise ValueError('must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": "..."}}')


ToolChoice = Annotated[Any, BeforeValidator(
    _tool_choice,
    json_schema_input_type=Literal["none", "auto", "required"] | dict[str, Any] | None)]


class _Base(BaseModel):
    """``extra="allow"`` so unknown fields can be reported by name (see module doc)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


def _surrogate_path(value: Any) -> str | None:
    """The dotted path of the first string (value or key) in ``value`` holding a lone
    UTF-16 surrogate (JSON may escape one, ``"\\ud800"``; it is no Unicode text and
    would fail the tokenizer or the response encoder later), or None.  Iterative, with
    C-speed fast paths for ASCII strings and lists of numbers (token ids)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path or None
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                    return path or "body"  # a key: name the object holding it
                stack.append((sub, item))
        elif isinstance(v, list):
            if set(map(type, v)) <= _SCALARS:
                continue
            stack.extend((f"{path}.{i}" if path else str(i), item)
                         for i, item in enumerate(v))
    return None


class _RequestBody(_Base):
    """A top-level request body: refuses lone surrogates anywhere in it (400 naming the
    field, see ``errors.validation_error_response``)."""

    @model_validator(mode="before")
    @classmethod
    def _no_surrogates(cls, data: Any) -> Any:
        path = _surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "unpaired_surrogate",
                "{param} contains a lone UTF-16 surrogate (not valid Unicode text)",
                {"param": path})
        return data


class StreamOptions(_Base):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


# Sampling fields shared by both endpoints, OpenAI's and vLLM's extras.
class _SamplingFields(_RequestBody):
    model: str | None = None
    frequency_penalty: Penalty | None = 0.0
    presence_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Num] | None = None
    n: Int | None = Field(default=1)
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    # vLLM extras (documented in docs/server.md).
    top_k: Int | None = None
    min_p: Annotated[Num, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Num, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    priority: Int = 0
    request_id: str | None = None
    # Output constraints (entrypoints/openai/structured.py) and token restrictions.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None

    def check_common(self, max_n: int) -> None:
        """Cross-field checks shared by both endpoints (400 each)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true",
                               "stream_options")
        if self.n is not None and not 1 <= self.n <= max_n:
            # Rejected before any per-sequence work (RELIABILITY: n above a cap).
            raise RequestError(f"n must be between 1 and {max_n}, got {self.n}", "n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise RequestError(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, "
                               f"got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise RequestError("stop must not contain empty strings", "stop")
        if self.top_k is not None and self.top_k < -1:
            raise RequestError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}",
                               "top_k")

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """``logit_bias`` with integer keys checked against the vocabulary; values are
        clamped to [-100, 100] as OpenAI does."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}",
                                   "logit_bias") from None
            if not 0 <= tid < vocab_size:
                raise RequestError(f"logit_bias key {tid} is outside the vocabulary "
                                   f"[0, {vocab_size})", "logit_bias")
            out[tid] = max(-100.0, min(100.0, float(value)))
        return out

    def sampling_kwargs(self, vocab_size: int) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` common to both endpoints."""
        top_k = self.top_k
        if top_k == 0:  # vLLM (and HF) spell "disabled" as 0 too.
            top_k = -1
        kw: dict[str, Any] = dict(
            n=self.n or 1,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if top_k is None else top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias_ids(vocab_size),
        )
        from pagedllm.entrypoints.openai.structured import structured_outputs_of

        kw["structured_outputs"] = structured_outputs_of(self)
        if self.bad_words:
            kw["bad_words"] = self.bad_words
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or max(self.allowed_token_ids) >= vocab_size:
                raise RequestError(f"allowed_token_ids must be a non-empty list of ids "
                                   f"in [0, {vocab_size})", "allowed_token_ids")
            kw["allowed_token_ids"] = self.allowed_token_ids
        return kw


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise RequestError(f"{name} must be at least 1, got {value}", name)


def build_sampling_params(kwargs: dict[str, Any], param_hint: str | None = None
                          ) -> SamplingParams:
    """``SamplingParams(**kwargs)``; its ``ValueError`` (which names the parameter) becomes
    a ``RequestError`` with ``param`` set to the first word of the message."""
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else "invalid sampling parameters"
        param = msg.split(" ", 1)[0] if msg else param_hint
        raise RequestError(msg, param if param in kwargs else param_hint) from None


# ----------------------------------------------------------------------------- completions

PromptType = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptType
    best_of: Int | None = None
    echo: Bool = False
    logprobs: Int | None = None
    max_tokens: Int | None = None
    suffix: str | None = None
    # vLLM extras.
    add_special_tokens: Bool = True
    prompt_logprobs: Int | None = None
    response_format: dict[str, Any] | None = None
    # Each choice also carries its generated ``token_ids`` (streaming: the chunk's new
    # ones) and ``prompt_token_ids`` (streaming: in its first chunk), as in vLLM.
    return_token_ids: Bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids), 400 if empty."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise RequestError("prompt must not be empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        for one in prompts:
            if (isinstance(one, str) and one == "") or (isinstance(one, list) and not one):
                raise RequestError("prompt must not be empty", "prompt")
            if isinstance(one, list) and any(t < 0 for t in one):
                raise RequestError("prompt token ids must be >= 0", "prompt")
        return prompts

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: prompt scoring (as vLLM accepts it): the prompt
        comes back (with its logprobs when asked), nothing is generated."""
        return self.echo and self.max_tokens == 0

    def validate_request(self, max_n: int, max_logprobs: int) -> None:
        self.check_common(max_n)
        if not self.prompt_only:
            _check_max_tokens(self.max_tokens, "max_tokens")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError("best_of other than n is not supported", "best_of")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= max_logprobs:
                raise RequestError(f"{name} must be between 0 and {max_logprobs}, got {v}",
                                   name)

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        kw = self.sampling_kwargs(vocab_size)
        # Omitted max_tokens means "the remaining context" (None; the engine fills it).
        # Prompt only: the engine runs one token (as vLLM does), the handler drops it.
        kw.update(max_tokens=1 if self.prompt_only else self.max_tokens,
                  logprobs=self.logprobs)
        prompt_lp = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_lp is None:
            prompt_lp = self.logprobs  # echo + logprobs returns the prompt's logprobs too
        kw["prompt_logprobs"] = prompt_lp
        return build_sampling_params(kw)


# ----------------------------------------------------------------------------- chat


class ChatMessage(_Base):
    """One message; extra keys (``name``, ``tool_call_id`` ...) are passed to the template."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as plain text; only ``{"type": "text"}`` parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"content parts of type {part.get('type')!r} are not supported "
                    "(text only)", "messages")
            parts.append(part["text"])
        return "".join(parts)


# OpenAI chat fields we accept but that change nothing for a text-only local model.
IGNORED_CHAT_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls",
                       "prompt_cache_key", "safety_identifier", "reasoning_effort",
                       "verbosity")


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    # OpenAI fields accepted and ignored (see IGNORED_CHAT_FIELDS) ...
    store: Bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    parallel_tool_calls: Bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # ... and OpenAI fields refused with "not supported" unless trivially satisfied.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM extras.
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def validate_request(self, max_n: int, max_logprobs: int) -> None:
        self.check_common(max_n)
        _check_max_tokens(self.max_tokens, "max_tokens")
        _check_max_tokens(self.max_completion_tokens, "max_completion_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true",
                                   "top_logprobs")
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise RequestError(f"top_logprobs must be between 0 and {max_logprobs}, "
                                   f"got {self.top_logprobs}", "top_logprobs")
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "audio": self.audio is not None,
            "modalities": bool(self.modalities) and self.modalities != ["text"],
            "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
        }
        for name, bad in unsupported.items():
            if bad:
                raise RequestError(f"{name} is not supported by this server yet", name)
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot "
                               "both be true", "continue_final_message")

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        kw = self.sampling_kwargs(vocab_size)
        max_tokens = self.max_completion_tokens or self.max_tokens
        kw.update(max_tokens=max_tokens,
                  logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        return build_sampling_params(kw)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for ``apply_chat_template`` (content flattened)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = dict(m.model_extra or {})
            d.update(role=m.role, content=m.text())
            out.append(d)
        return out


# ----------------------------------------------------------------------------- tokenize


class TokenizeRequest(_RequestBody):
    """``POST /tokenize``: either ``prompt`` or ``messages``.  With ``messages`` (vLLM's
    chat form) the prompt is rendered exactly as ``/v1/chat/completions`` renders it,
    so ``tools``, ``chat_template_kwargs``, ``continue_final_message`` and
    ``chat_template`` mean what they mean there."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is (``add_special_tokens`` as chat's
        default, False, unless the client set it)."""
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot "
                               "both be true", "continue_final_message")
        special = self.add_special_tokens if "add_special_tokens" in \
            self.model_fields_set else False
        return ChatCompletionRequest(
            messages=self.messages or [], tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=special, chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]]


# ----------------------------------------------------------------------------- responses


# Response bodies: the handlers build plain dicts on the hot path (one per streamed
# token); these models document them in /openapi.json.
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
