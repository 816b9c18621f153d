"""One step's rotary inputs (``RopeInputs``), the type the model hands its layers and the
attention backends, and a layer's per-head query/key norms (``QKNorm``) that such a
backend may fuse in before it rotates.

It lives here, below both ``layers/`` and the backends, so that a backend which fuses the
rotation into its KV write (``AttentionBackend.fuses_rope``) and the layers that rotate in
torch share one type without the backends importing the layer package.  The tables it
carries are built by ``layers/rotary.py:RotaryEmbedding``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, H, D]`` (any strides) by ``cos``/``sin: [T, 1, R/2]`` on its first
    ``R`` features (the rest pass through: partial rotary, Phi); new tensor."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class RopeInputs:
    """One step's rotary inputs, shared by every layer.

    Two ways to use it: ``rotate(x)`` (torch; the cos/sin gather and dtype cast happen
    once per step, on first use), or hand ``positions`` and ``cos_sin_cache`` to a kernel
    that rotates while it writes the KV cache (``AttentionBackend.fuses_rope``).
    """

    positions: torch.Tensor  # [T] int
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cat(cos, sin)
    dtype: torch.dtype  # the activations' dtype
    _cos: torch.Tensor | None = None
    _sin: torch.Tensor | None = None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, H, D]`` (any strides) rotated, as a new tensor."""
        if self._cos is None or self._sin is None:
            cos_sin = self.cos_sin_cache.index_select(0, self.positions).to(self.dtype)
            self._cos, self._sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary(x, self._cos, self._sin)


@dataclass(frozen=True)
class QKNorm:
    """A layer's per-head RMSNorms of queries and keys, applied before the rotation (Qwen3,
    Gemma 3), handed to ``AttentionBackend.forward_rope`` so that a backend which rotates
    in its KV write can norm in the same launch (``kernels/rotary.py``).

    ``q`` and ``k`` are the layer's norm modules over ``head_dim`` (``weight``, ``eps``;
    read at call time, so weight loading after construction is seen); ``gemma``: Gemma's
    arithmetic, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32 with one rounding, else
    Llama's, the normed value rounded to the activation dtype before the weight multiply.
    ``apply`` runs the modules themselves: what a backend does when it does not fuse."""

    q: torch.nn.Module
    k: torch.nn.Module
    gemma: bool

    @property
    def eps(self) -> float:
        return float(self.q.eps)  # type: ignore[arg-type]

    def apply(self, query: torch.Tensor, key: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q(query), k(key))`` on ``[T, H, D]`` views, as new tensors."""
        return self.q(query), self.k(key)
