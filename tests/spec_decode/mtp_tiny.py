"""Tiny random DeepSeek-V3 checkpoints with a multi-token-prediction (MTP) layer, built
offline: transformers writes the target (its ``DeepseekV3ForCausalLM`` has no MTP
layer), and the MTP layer's tensors are added to its safetensors file under
``model.layers.{N}.`` (N = ``num_hidden_layers``) with the ``safetensors`` library, in
the released checkpoints' names; ``config.json`` says ``num_nextn_predict_layers: 1``.

* ``write_random``: the decoder-layer part of the MTP layer is layer N of a random
  (N + 1)-layer model that transformers saved (so its names and per-expert layout are
  what ``save_pretrained`` writes); that model's layer N is returned as the reference.
* ``write_near_copy``: a 1-layer MoE target whose MTP layer copies its layer 0
  (``eh_proj = [I 0]``, unit-RMS embeddings, ``shared_head.norm`` = the final norm,
  the target's embedding and LM head): the layer at position p then computes the
  target's state at p + 1 from nearly the same context (the first token missing), so
  its drafts are mostly the target's greedy tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.models.tiny_models import randomize

VOCAB = 320
H = 64


def v3_config(layers: int, first_dense: int) -> transformers.DeepseekV3Config:
    """The tiny V3 of ``tests/models/deepseek_tiny.py`` (MLA with query LoRA, grouped
    sigmoid routing), ``layers`` decoder layers, MoE from ``first_dense`` on."""
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24,
        first_k_dense_replace=first_dense, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
        architectures=["DeepseekV3ForCausalLM"])


def _random_model(cfg: Any, seed: int) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    randomize(hf, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # a correction bias that changes which experts win
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return hf


def _finish(path: str, layers: int, extra: dict[str, torch.Tensor]) -> None:
    """Add ``extra`` to the saved safetensors file; set the config's layer count to
    ``layers`` (a layer saved past it is the MTP layer's) and ``num_nextn_predict_layers``
    to 1."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(extra)
    save_file({k: v.contiguous() for k, v in tensors.items()}, file, {"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    cfg["num_nextn_predict_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def mtp_extras(n: int, seed: int, own_embed: bool, own_head: bool
               ) -> dict[str, torch.Tensor]:
    """Random ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (and optionally
    ``shared_head.head``, ``embed_tokens``) of MTP layer ``n``."""
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{n}."
    t = {p + "enorm.weight": torch.rand(H, generator=g) + 0.5,
         p + "hnorm.weight": torch.rand(H, generator=g) + 0.5,
         p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5,
         p + "shared_head.norm.weight": torch.rand(H, generator=g) + 0.5}
    if own_head:
        t[p + "shared_head.head.weight"] = torch.randn(VOCAB, H, generator=g) * 0.3
    if own_embed:
        t[p + "embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    return t


def write_random(path: str, layers: int = 2, first_dense: int = 1, seed: int = 0, *,
                 own_embed: bool = False, own_head: bool = False
                 ) -> tuple[Any, dict[str, torch.Tensor]]:
    """A random ``layers``-layer V3 target with a random MTP layer at index ``layers``
    (MoE when ``layers >= first_dense``) at ``path``.  Returns transformers' (layers +
    1)-layer model, whose last layer is the MTP layer's decoder layer, and the MTP
    layer's other tensors (checkpoint names)."""
    hf = _random_model(v3_config(layers + 1, first_dense), seed)
    hf.save_pretrained(path, safe_serialization=True)
    extra = mtp_extras(layers, seed + 3, own_embed, own_head)
    _finish(path, layers, extra)
    return hf, extra


def write_near_copy(path: str, seed: int = 0) -> Any:
    """The near-copy MTP layer of a 1-layer MoE target (module doc); returns the HF
    target."""
    hf = _random_model(v3_config(1, 0), seed)
    with torch.no_grad():
        e = hf.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
        hf.lm_head.weight.mul_(4.0)  # sharp logits: no near-ties
    hf.save_pretrained(path, safe_serialization=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    extra = {k.replace("model.layers.0.", "model.layers.1."): v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.0.")}
    extra.update({"model.layers.1.enorm.weight": torch.ones(H),
                  "model.layers.1.hnorm.weight": torch.ones(H),
                  "model.layers.1.eh_proj.weight": torch.cat(
                      [torch.eye(H), torch.zeros(H, H)], dim=1),
                  "model.layers.1.shared_head.norm.weight": tensors["model.norm.weight"]})
    _finish(path, 1, extra)
    return hf
