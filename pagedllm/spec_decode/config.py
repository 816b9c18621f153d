"""SpeculativeConfig: what ``speculative_config={...}`` / ``--speculative-config JSON``
asks for, validated once (vLLM's key names).  Torch-free: the scheduler reads it.

``method``:

* ``"ngram"`` -- prompt lookup: the longest suffix of the sequence (between
  ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens) that occurred earlier proposes
  the tokens that followed it (``worker/spec_decode/ngram.py``).
* ``"draft_model"`` -- a smaller model with the target's vocabulary (``model``: its path;
  the method is inferred from ``model``) proposes its greedy continuation
  (``worker/spec_decode/draft_model.py``).  ``EngineArgs`` resolves the path into
  ``draft_model_config`` (a ``pagedllm.config.ModelConfig``) and checks the vocabulary.
* ``"eagle"`` / ``"eagle3"`` -- an EAGLE / EAGLE-3 head (``model``: its checkpoint, in
  the published layout) proposes its greedy continuation from the target's hidden
  states (``worker/spec_decode/eagle.py``); resolved into ``draft_model_config`` likewise.
* ``"mtp"`` (alias ``"deepseek_mtp"``, vLLM's names) -- a DeepSeek-V3 checkpoint's own
  multi-token-prediction layer (``num_nextn_predict_layers``) proposes its greedy
  continuation from the target's hidden states (``models/deepseek_mtp.py``,
  ``worker/spec_decode/mtp.py``).  No ``model``: the layer is read from the target's
  checkpoint; ``EngineArgs`` fills ``draft_model_config`` with the layer's KV shape.

``num_speculative_tokens`` (k) drafts per request per step; the target verifies them and
its bonus token in one forward.  How many drafts a step verifies is decided per step
from the measured step-cost curve and the acceptance seen (``spec_decode/policy.py``);
``disable_by_batch_size`` (vLLM's name) is a hard cap on top: no drafts in a step where
more requests than this run (default None: no cap, the policy alone decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Other names accepted for a method (vLLM's), normalised on validation.
METHOD_ALIASES = {"deepseek_mtp": "mtp"}
# Methods whose ``model`` is a separate checkpoint with its own KV (draft_model.py).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# Methods whose proposer keeps KV of its own in the target's blocks (draft_model.py).
DRAFT_KV_METHODS = (*MODEL_METHODS, "mtp")
# Methods whose proposer reads the target step's hidden states (eagle_proposer.py).
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp")
# No fixed batch-size cap by default: the per-step policy turns speculation down as the
# measured cost of verifying k + 1 tokens per request outgrows the expected tokens.
DEFAULT_DISABLE_BY_BATCH_SIZE: int | None = None
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size", "model")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config: {name} must be an integer >= {minimum}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # MODEL_METHODS: the draft's path as given, and its resolved ModelConfig; "mtp":
    # no path, the ModelConfig of the target's MTP layer (filled in by
    # EngineArgs.create_engine_config; Any: this module stays torch- and config-free).
    model: str | None = None
    draft_model_config: Any = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Validate the user's dict; ValueError naming the field on anything wrong."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {raw!r}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(_KEYS)}")
        method = raw.get("method")
        model = raw.get("model")
        if method is None and model is not None:
            method = "draft_model"  # vLLM infers it from the model (EAGLE heads aside)
        if method is None and "prompt_lookup_max" in raw:
            method = "ngram"  # vLLM infers it the same way
        method = METHOD_ALIASES.get(method, method) if isinstance(method, str) else method
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(METHODS)}, got {method!r}")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config: model is not used by method 'ngram'")
        if method == "mtp" and model is not None:
            raise ValueError("speculative_config: model is not used by method 'mtp' (the "
                             "MTP layer is read from the target model's checkpoint)")
        if method in MODEL_METHODS and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config: method {method!r} needs model (the "
                             f"draft's path), got {model!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        k = _int("num_speculative_tokens", raw["num_speculative_tokens"], 1)
        if k > 32:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= 32, "
                             f"got {k}")
        lo = _int("prompt_lookup_min", raw.get("prompt_lookup_min", 1), 1)
        hi = _int("prompt_lookup_max", raw.get("prompt_lookup_max", max(lo, 4)), 1)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        dbs = raw.get("disable_by_batch_size")
        dbs = DEFAULT_DISABLE_BY_BATCH_SIZE if dbs is None else _int(
            "disable_by_batch_size", dbs, 1)
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo,
                   prompt_lookup_max=hi, disable_by_batch_size=dbs, model=model)
