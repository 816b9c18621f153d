"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position rows.

Every token has three positions -- temporal, height, width.  Text tokens have the same
number in all three; an image's tokens count its grid (``models/qwen2_vl.py``'s
``get_mrope_input_positions``).  The rotated frequency pairs are split into
``mrope_section = [t, h, w]`` consecutive groups (their sum is ``rotary_dim / 2``), and
pair ``i`` of section ``s`` rotates by ``position[s] * inv_freq[i]``::

  cos/sin table  [max_pos, R] = cat(cos, sin)  (layers/rotary.py, plain RoPE)
  positions      [3, T]
  step table     [T, R]: column c from row positions[section(c), t]
  RopeInputs(arange(T), step table)           -> every layer, every backend unchanged

Handing the layers a per-step table indexed by ``arange(T)`` keeps ``RopeInputs`` and the
backends that rotate inside their KV write (``fuses_rope``) untouched, and it is all
device ops, so CUDA graphs capture it.  Positions of shape ``[T]`` (text steps, the
memory profile) are the plain RoPE, which equals M-RoPE with three equal rows.  As
transformers does, the table is float32, cast to the activations' dtype at use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.rope import RopeInputs
from pagedllm.layers.rotary import RotaryEmbedding, rotary_dim_of

# transformers' default when a config names none (Qwen2-VL-7B's head_dim 128).
DEFAULT_MROPE_SECTION = (16, 24, 24)


def mrope_section_of(params: dict[str, Any]) -> list[int]:
    """``mrope_section`` from rope parameters (transformers 5 ``rope_parameters`` or 4's
    ``rope_scaling``, both folded in by ``layers/rotary.rope_parameters``)."""
    section = params.get("mrope_section") or DEFAULT_MROPE_SECTION
    return [int(s) for s in section]


class MRotaryEmbedding(nn.Module):
    """``inputs(positions [3, T] or [T], dtype) -> RopeInputs`` (see the module doc)."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        params = dict(params)
        if params.get("rope_type") in ("mrope", None):  # transformers 4's name
            params["rope_type"] = "default"
        section = mrope_section_of(params)
        rot = rotary_dim_of(head_dim, params)
        if sum(section) != rot // 2:
            raise ValueError(f"mrope_section {section} must sum to rotary_dim / 2 = "
                             f"{rot // 2}")
        rope = RotaryEmbedding(head_dim, max_position, params)
        self.head_dim, self.rotary_dim = head_dim, rope.rotary_dim
        self.register_buffer("cos_sin_cache", rope.cos_sin_cache, persistent=False)
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        # Column c of cat(cos, sin) -> its position row (the sin half mirrors cos).
        self.register_buffer("section", torch.cat((half, half)).to(rope.cos_sin_cache.device),
                             persistent=False)

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        if positions.dim() == 1:
            return RopeInputs(positions, self.cos_sin_cache, dtype)
        t = positions.shape[-1]
        rows = self.cos_sin_cache.index_select(0, positions.reshape(-1)).view(3, t, -1)
        step = rows.gather(0, self.section.view(1, 1, -1).expand(1, t, -1)).squeeze(0)
        return RopeInputs(torch.arange(t, device=positions.device), step, dtype)
