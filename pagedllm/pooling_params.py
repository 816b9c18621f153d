"""Parameters of a pooling request (vLLM's ``PoolingParams``): what to do with the pooled
hidden state of a prompt.

``task``: ``"embed"`` (a vector; ``LLM.embed``, ``/v1/embeddings``), ``"classify"`` (the
classification head's probabilities), ``"score"`` (a cross-encoder's relevance of a
sentence pair: ``LLM.score``, ``/v1/score``, ``/rerank``) or ``"encode"`` (the raw pooled
vector).  ``normalize`` (embed; None: the model's default) divides by the L2 norm after
``dimensions`` (Matryoshka) has kept the first ``dimensions`` entries -- only where the
model config declares Matryoshka support (``matryoshka_dimensions`` or
``is_matryoshka``).  ``use_activation`` (classify/score; None: on) applies sigmoid for one
label, softmax for more, as sentence-transformers' ``CrossEncoder`` does.

``token_type_ids`` is set by the frontend for sentence pairs (BERT's segment ids); users
do not pass it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, "
                             f"got {self.task!r}")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a boolean, got {v!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")

    def verify(self, hf_config: Any, hidden_size: int, supported_tasks: tuple[str, ...],
               ) -> None:
        """``ValueError`` naming the parameter when the model cannot honour it."""
        if self.task not in supported_tasks:
            raise ValueError(f"task: this model supports {', '.join(supported_tasks)}, "
                             f"not {self.task!r}")
        if self.dimensions is None:
            return
        if self.task != "embed":
            raise ValueError("dimensions applies to embeddings (task 'embed') only")
        allowed = matryoshka_dimensions(hf_config, hidden_size)
        if allowed is None:
            raise ValueError("dimensions: this model does not support Matryoshka "
                             "representation; leave dimensions unset")
        if self.dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {allowed} for this model, got "
                             f"{self.dimensions}")


def matryoshka_dimensions(hf_config: Any, hidden_size: int) -> list[int] | None:
    """The ``dimensions`` a model accepts: its ``matryoshka_dimensions``, any size up to
    ``hidden_size`` when it only says ``is_matryoshka``, None when it says neither
    (vLLM reads the same two config keys)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    if getattr(hf_config, "is_matryoshka", False):
        return list(range(1, hidden_size + 1))
    return None


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns hidden states into its result (``ModelConfig.
    pooler_config``; vLLM's ``PoolerConfig``).  ``pooling_type``: ``"cls"``, ``"mean"``
    or ``"last"``; ``normalize``: the default for embeddings; ``tasks``: the pooling
    tasks the served model takes (``supported_tasks``)."""

    pooling_type: str
    normalize: bool
    tasks: tuple[str, ...]
