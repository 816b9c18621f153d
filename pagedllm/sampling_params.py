"""SamplingParams: how to pick and when to stop, validated on construction.

Names and defaults follow vLLM's ``SamplingParams`` so client code ports unchanged.
Every invalid value raises ``ValueError`` naming the parameter and its allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from pagedllm.structured_outputs_params import StructuredOutputsParams, coerce

_SAMPLING_EPS = 1e-5
# ``seed`` is an int64, as in vLLM (torch generators and int64 seed tensors carry it).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def child_seed(seed: int, index: int) -> int:
    """The seed of parallel sample ``index`` of a request seeded with ``seed``:
    ``seed + index`` wrapped into the int64 range, so ``SEED_MAX`` with ``n=2`` stays a
    valid seed instead of overflowing the generator in the engine core."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _normalise_logit_bias(bias: object) -> dict[int, float]:
    """Integer keys (JSON sends strings) and float values, or ``ValueError`` naming it."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if isinstance(k, (bool, float)) or (isinstance(k, str) and str(tid) != k.strip()):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        out[tid] = _check_number("logit_bias", v)
    return out


@dataclass
class SamplingParams:
    """Sampling and stopping for one request (``n`` samples of it).

    ``max_tokens=None`` means "up to the model's context length"; the engine fills it in.
    ``seed`` makes a request's samples reproducible whatever else is in the batch.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Extra: the vLLM name for beam search on a request.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Prefix caching: requests only share cached KV blocks when their salts are equal.
    cache_salt: str | None = None
    # Output constraints (structured_output/): JSON schema, regex, choice, grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Words never to generate (the input processor fills ``bad_words_token_ids``).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Offline API only (they cannot cross a socket): callables
    # ``fn(output_token_ids, logits) -> logits`` or ``fn(prompt_token_ids,
    # output_token_ids, logits) -> logits`` over the row's ``[V]`` fp32 logits.
    logits_processors: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.structured_outputs = coerce(self.structured_outputs)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) \
                else list(self.bad_words)
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1  # vLLM (and HF) also spell "disabled" as 0
        self._verify()
        # Greedy sampling ignores the truncation knobs: normalise them so the sampler's
        # fast path sees one canonical "greedy" request.
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _verify(self) -> None:
        n = _check_int("n", self.n)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if self.best_of is not None and _check_int("best_of", self.best_of) < n:
            raise ValueError(f"best_of must be >= n ({n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _check_number(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        rp = _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < rp <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {rp}")
        t = _check_number("temperature", self.temperature)
        if t < 0.0 or t > 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {t}")
        tp = _check_number("top_p", self.top_p)
        if not 0.0 < tp <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {tp}")
        tk = _check_int("top_k", self.top_k)
        if tk < -1 or tk == 0:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {tk}")
        mp = _check_number("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        if self.seed is not None and not SEED_MIN <= _check_int("seed", self.seed) <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (int64), got "
                             f"{self.seed}")
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        mt = _check_int("min_tokens", self.min_tokens)
        if mt < 0:
            raise ValueError(f"min_tokens must be >= 0, got {mt}")
        if self.max_tokens is not None and mt > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {mt}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and _check_int(name, v) < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        for tid in self.stop_token_ids or []:
            if _check_int("stop_token_ids", tid) < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {tid}")
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if k < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {k}")
                _check_number("logit_bias", v)
                self.logit_bias[k] = max(-100.0, min(100.0, v))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {self.cache_salt!r}")
        _check_number("length_penalty", self.length_penalty)
        self._verify_extras()
        if self.use_beam_search and self.temperature > _SAMPLING_EPS:
            # vLLM's rule: beam search is deterministic.
            raise ValueError("temperature must be 0 when use_beam_search is set")

    def _verify_extras(self) -> None:
        for w in self.bad_words or []:
            if not isinstance(w, str) or not w:
                raise ValueError(f"bad_words must contain non-empty strings, got {w!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                if _check_int("allowed_token_ids", t) < 0:
                    raise ValueError(f"allowed_token_ids must be >= 0, got {t}")
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, list) or not all(
                    callable(f) for f in self.logits_processors):
                raise ValueError("logits_processors must be a list of callables")
        if self.structured_outputs is not None and self.use_beam_search:
            raise ValueError("structured_outputs is not supported with use_beam_search")

    @property
    def needs_output_tokens(self) -> bool:
        """Whether sampling this request reads its output so far (bad words of
        several tokens, logits processors), so each step must see the previous one's."""
        return bool(self.logits_processors) or any(
            len(ids) > 1 for ids in self.bad_words_token_ids or [])

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with ``changes`` applied (re-validated)."""
        from dataclasses import asdict, fields

        # Not ``asdict(self)`` whole: it would deep-copy the logits processors.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.structured_outputs is not None:
            d["structured_outputs"] = asdict(self.structured_outputs)
        for name in ("stop", "stop_token_ids", "bad_words", "allowed_token_ids",
                     "logits_processors"):
            if isinstance(d[name], list):
                d[name] = list(d[name])
        if self.logit_bias is not None:
            d["logit_bias"] = dict(self.logit_bias)
        d.update(changes)
        return SamplingParams(**d)  # type: ignore[arg-type]
