"""FP8 MoE checkpoints of the tiny MoE models (``tests/models/tiny_models.py``), written by
the compressed-tensors library.

transformers keeps a MoE's experts as stacked 3-D parameters (no ``nn.Linear`` per
expert), so compressed-tensors' ``apply_quantization_config`` -- which quantises
``Linear`` modules -- cannot see them in the HF model.  The checkpoint, though, names
every expert matrix (``model.layers.0.mlp.experts.3.gate_proj.weight``), so the fixture
rebuilds those matrices as a tree of ``nn.Linear`` modules under the checkpoint's names,
lets the library quantise and compress that tree (its own observer maths, its own
``float-quantized`` compressor, its own ``quantization_config``), and writes the result
back over the float checkpoint's expert tensors.  The config group targets the experts
only, so the oracle is exact: the HF model with the dequantised expert weights.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

EXPERTS = "re:.*experts.*"


def _linear_tree(weights: dict[str, torch.Tensor]) -> nn.Module:
    """``nn.Linear`` modules (no bias) at the module paths of ``weights``' names."""
    root = nn.Module()
    for name, w in weights.items():
        *path, leaf = name.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        parent.add_module(leaf, lin)
    return root


def save_compressed_tensors_moe(path: str, preset: str,
                                block: tuple[int, int] = (16, 16)) -> dict[str, torch.Tensor]:
    """Rewrite the float checkpoint in ``path`` with its experts quantised by
    compressed-tensors' ``preset`` ("FP8_DYNAMIC": per-channel weights; "FP8": per-tensor
    weights, static input scales; "FP8_BLOCK": ``block`` weight blocks instead of the
    preset's 128 x 128, which a tiny model cannot hold) and compressed
    (``float-quantized``); returns the float state dict with each expert weight
    replaced by its dequantised value."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    experts = {k: v for k, v in state.items() if ".experts." in k and k.endswith(".weight")}
    tree = _linear_tree(experts)
    scheme = preset_name_to_scheme(preset, [EXPERTS])
    if scheme.weights.strategy == "block":
        scheme.weights.block_structure = list(block)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(tree, qc)
    with torch.no_grad():
        for _, mod in tree.named_modules():
            scheme = getattr(mod, "quantization_scheme", None)
            if scheme is None:
                continue
            w = mod.weight.data
            # min / max are the observer's whole job; the library turns them into scales.
            if scheme.weights.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif scheme.weights.strategy == "block":
                blocks = w.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))
                lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
            else:
                lo, hi = w.amin(), w.amax()
            scale, _ = calculate_qparams(lo, hi, scheme.weights)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "input_scale"):
                mod.input_scale.data.fill_(0.02)
    comp = ModelCompressor.from_pretrained_model(tree, "float-quantized")
    comp.compress_model(tree)
    compressed = {k: v.contiguous() for k, v in tree.state_dict().items()}
    assert any(v.dtype == torch.float8_e4m3fn for v in compressed.values())
    deq = dict(state)
    for name in experts:
        stem = name.removesuffix("weight")
        q, s = compressed[name], compressed[stem + "weight_scale"]
        s = s.float()
        if s.dim() == 2 and s.shape[1] > 1:  # block scales
            s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        else:  # per channel [out, 1], or per tensor
            s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(())
        deq[name] = q.float() * s
    save_file({**{k: v for k, v in state.items() if k not in experts}, **compressed}, file)
    comp.update_config(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["format"] == "float-quantized"
    return deq
