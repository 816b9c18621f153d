"""M-RoPE (layers/mrope.py) equals transformers' Qwen2-VL rotary bit for bit (fp32): q and k
rotated from three position rows by ``mrope_section``, through ``RopeInputs`` as every
layer and backend uses it; ``[T]`` positions are plain RoPE (three equal rows)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

from pagedllm.layers.mrope import MRotaryEmbedding


@pytest.mark.parametrize("head_dim,section,theta", [(16, [2, 3, 3], 10000.0),
                                                    (128, [16, 24, 24], 1e6)])
def test_rotation_equals_transformers(head_dim: int, section: list[int], theta: float):
    heads = 3
    params = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    cfg = transformers.Qwen2VLTextConfig(hidden_size=head_dim * heads,
                                         num_attention_heads=heads,
                                         max_position_embeddings=4096,
                                         rope_parameters=params)
    ref = hf.Qwen2VLRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    t = 37
    pos = torch.randint(0, 4000, (3, t), generator=g)
    q = torch.randn(t, heads, head_dim, generator=g)
    k = torch.randn(t, heads, head_dim, generator=g)
    cos, sin = ref(q, pos.unsqueeze(1))  # [1, T, D]
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0),
                                             k.transpose(0, 1).unsqueeze(0), cos, sin)
    ours = MRotaryEmbedding(head_dim, 4096, params)
    rope = ours.inputs(pos, torch.float32)
    assert torch.equal(rope.rotate(q), want_q[0].transpose(0, 1))
    assert torch.equal(rope.rotate(k), want_k[0].transpose(0, 1))
    # Equal rows: the plain RoPE of [T] positions.
    flat = pos[0]
    same = ours.inputs(flat.expand(3, -1).contiguous(), torch.float32).rotate(q)
    assert torch.equal(same, ours.inputs(flat, torch.float32).rotate(q))


def test_section_must_cover_half_the_rotary_dim():
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 1e4,
                                  "mrope_section": [2, 2, 2]})
