"""Test fixtures for FP8 checkpoints, written by the formats' own libraries: the
compressed-tensors library (``apply_quantization_config`` + ``ModelCompressor``) and
transformers' fine-grained FP8 quantiser (``Fp8Quantize``), from tiny random Llamas."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import transformers


def tiny_llama(seed: int = 0, **overrides: object) -> transformers.LlamaForCausalLM:
    """A random 2-layer Llama (GQA 2:1, untied head) with every weight randomised."""
    cfg = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model


def save_compressed_tensors(model: torch.nn.Module, path: str, preset: str,
                            ignore: list[str] | None = None) -> torch.nn.Module:
    """Quantise ``model`` with compressed-tensors' ``preset`` ("FP8_DYNAMIC": per-channel
    weights, dynamic per-token activations; "FP8": per-tensor, static activations) and
    save it compressed ("float-quantized") under ``path``.  Returns the fake-quantised
    model in the library's own forward (the oracle), taken before compression."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            ignore=ignore or ["lm_head"])
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for _, mod in model.named_modules():
            scheme = getattr(mod, "quantization_scheme", None)
            if scheme is None:
                continue
            w = mod.weight.data
            # min / max are the observer's whole job; the library turns them into scales.
            if scheme.weights.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                lo, hi = w.amin(), w.amax()
            scale, _ = calculate_qparams(lo, hi, scheme.weights)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "input_scale"):
                mod.input_scale.data.fill_(0.02)
    oracle = copy.deepcopy(model)
    comp = ModelCompressor.from_pretrained_model(model, "float-quantized")
    comp.compress_model(model)
    model.save_pretrained(path)
    comp.update_config(path)
    return oracle


def save_hf_fp8(model: torch.nn.Module, path: str, block: tuple[int, int]) -> dict:
    """Save ``model`` as a transformers fine-grained FP8 checkpoint (``weight`` e4m3,
    ``weight_scale_inv`` per ``block``), quantised by transformers' own ``Fp8Quantize``.
    Returns the dequantised state dict (transformers' ``Fp8Dequantize`` semantics: the
    weight times its block's ``weight_scale_inv``)."""
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qconf = transformers.FineGrainedFP8Config(weight_block_size=list(block))
    op = Fp8Quantize(SimpleNamespace(quantization_config=qconf))
    state, deq = {}, {}
    for name, t in model.state_dict().items():
        if name.endswith("proj.weight"):
            out = op.convert({name: t})
            q, inv = out[name], out[name[:-len("weight")] + "weight_scale_inv"]
            state[name], state[name[:-len("weight")] + "weight_scale_inv"] = q, inv
            full = inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            deq[name] = q.float() * full
        else:
            state[name] = t.contiguous()
            deq[name] = t
    model.config.save_pretrained(path)
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {**qconf.to_dict(), "quant_method": "fp8"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq
