"""Our cos/sin tables against transformers' own rotary embedding modules, for every RoPE
scaling we support: each row of ``RotaryEmbedding.cos_sin_cache`` must equal HF's cos
and sin at that position (float32, bit-level tolerance).  LongRoPE: HF picks short or
long factors for the whole sequence by its length, so the short rows are compared with
a sequence inside the original context and the long rows with one beyond it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters

HEAD, MAX_POS = 32, 256
LLAMA = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS)


def _hf_cos_sin(module: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n)[None]
    cos, sin = module(torch.zeros(1, n, HEAD), pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _ours(cfg) -> torch.Tensor:
    return RotaryEmbedding(HEAD, MAX_POS, rope_parameters(cfg)).cos_sin_cache


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "beta_fast": 16,
     "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
], ids=lambda p: p["rope_type"] + ("_mscale" if "mscale" in p else ""))
def test_scalings_match_transformers(params) -> None:
    cfg = transformers.LlamaConfig(**LLAMA, rope_parameters=dict(params))
    cos, sin = _hf_cos_sin(LlamaRotaryEmbedding(cfg), MAX_POS)
    ours = _ours(cfg)
    half = ours.shape[-1] // 2
    torch.testing.assert_close(ours[:, :half], cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, half:], sin, atol=1e-6, rtol=0)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_rows(partial: float) -> None:
    rot = int(HEAD * partial)
    cfg = transformers.Phi3Config(
        **LLAMA, pad_token_id=0, partial_rotary_factor=partial,
        original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(rot // 2)],
                      "long_factor": [2.0 + i / 3 for i in range(rot // 2)]})
    ours = _ours(cfg)
    assert ours.shape == (MAX_POS, rot)
    hf = Phi3RotaryEmbedding(cfg)
    short_cos, short_sin = _hf_cos_sin(hf, 64)  # within the original context
    long_cos, long_sin = _hf_cos_sin(hf, MAX_POS)  # beyond it: long factors throughout
    h = rot // 2
    torch.testing.assert_close(ours[:64, :h], short_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:64, h:], short_sin, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[64:, :h], long_cos[64:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[64:, h:], long_sin[64:], atol=1e-6, rtol=0)


def test_unknown_rope_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported.*yarn"):
        RotaryEmbedding(HEAD, 16, {"rope_type": "mrope", "rope_theta": 1e4})
