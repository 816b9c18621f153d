"""Attention kinds: what, besides causal masking, a layer's attention applies.

A model gives each attention layer an ``AttentionKind``; a backend declares which kinds
it serves (``AttentionBackend.supports``) and the layer refuses an unsupported one when
it is built, not mid-run.  The KV cache manager groups layers by kind (full vs sliding)
to free blocks that have left every sliding layer's window.

* ``sliding_window = W``: the query at position ``p`` sees keys at ``p - W < k <= p``
  (W keys, itself included: transformers' ``sliding_window_overlay``).
* ``logits_soft_cap = c``: scores ``s = q.k * scale`` become ``c * tanh(s / c)`` before
  masking and softmax (Gemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionKind:
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"attn_logit_softcapping must be > 0, got "
                             f"{self.logits_soft_cap}")

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.logits_soft_cap is None

    def describe(self) -> str:
        parts = [f"sliding_window={self.sliding_window}"] if self.sliding_window else []
        if self.logits_soft_cap:
            parts.append(f"logits_soft_cap={self.logits_soft_cap}")
        return ", ".join(parts) or "full"


FULL = AttentionKind()


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers applies it (None = full): with
    ``layer_types`` (Qwen2, Gemma) on ``"sliding_attention"`` layers; without (Mistral,
    Mixtral, Phi-3) on every layer when ``sliding_window`` is set."""
    window = getattr(hf_config, "sliding_window", None)
    window = int(window) if window else None
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


def uniform_sliding_window(hf_config: Any) -> int | None:
    """The window when every layer slides with the same one (the KV manager can then
    free blocks behind it), else None."""
    windows = set(layer_sliding_windows(hf_config))
    return windows.pop() if len(windows) == 1 else None
