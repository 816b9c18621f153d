"""Clear one-line errors: unknown architectures, missing/corrupt weight files, checkpoints
that lack tensors; plus the dummy loader and the registry."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_files.gguf_file import GGUFFile
from pagedllm.models.loader import kv_cache_shape, load_model
from pagedllm.models.registry import get_model_class
from tests.models.paged import PagedSession

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _save_tiny(path: str) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _load(path: str, load_format: str = "auto", **kw: Any) -> torch.nn.Module:
    cfg = EngineArgs(model=path, device="cpu", load_format=load_format,
                     **kw).create_engine_config()
    return load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())


def test_unknown_architecture_names_architectures() -> None:
    cfg = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="architectures.*GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(cfg)


def test_registry_dispatch() -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert get_model_class(transformers.PretrainedConfig(architectures=[arch])).__name__ \
            == arch
    # GGUF configs from transformers carry no `architectures`, only model_type.
    assert get_model_class(transformers.LlamaConfig()).__name__ == "LlamaForCausalLM"


def test_missing_safetensors(tmp_path) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    with pytest.raises(ValueError, match="no \\*.safetensors") as e:
        _load(path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_corrupt_safetensors(tmp_path) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 64)  # clobber the header length + JSON
    with pytest.raises(ValueError, match="model.safetensors") as e:
        _load(path)
    assert "\n" not in str(e.value)


def test_truncated_safetensors(tmp_path) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(path)


def test_checkpoint_missing_a_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = _save_tiny(str(tmp_path / "m"))
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 parameter.*layers.1.mlp.down_proj"):
        _load(path)


def test_shape_mismatch_names_tensor(tmp_path) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["intermediate_size"] = 48
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="checkpoint tensor .model.layers.0.mlp.*shape mismatch"):
        _load(path)


def test_corrupt_gguf(tmp_path, default_model_path) -> None:
    bad = tmp_path / "bad.gguf"
    with open(default_model_path, "rb") as f:
        bad.write_bytes(f.read(2_000_000))  # header intact, tensor data cut off
    with pytest.raises(ValueError, match="bad.gguf.*truncated"):
        GGUFFile(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        EngineArgs(model=str(junk), device="cpu").create_engine_config()


def test_dummy_load_runs(tmp_path) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    model = _load(path, load_format="dummy")
    cfg = EngineArgs(model=path, device="cpu").create_engine_config().model_config
    assert kv_cache_shape(cfg, 10, 16) == (2, 10, 16, 2, 8)
    s = PagedSession(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=8)
    logits = s.step({0: [1, 2, 3, 4, 5]})[0]
    assert logits.shape == (5, 128) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_dummy_init_uniform_default_and_normal(tmp_path) -> None:
    """Dummy weights: vLLM's uniform(-1e-3, 1e-3) on every parameter by default;
    ``{"dummy_init": "normal"}`` gives normal(0, 0.02) with norm weights 1."""
    path = _save_tiny(str(tmp_path / "m"))
    uni = _load(path, load_format="dummy")
    norm = _load(path, load_format="dummy",
                 model_loader_extra_config={"dummy_init": "normal"})
    for name, p in uni.named_parameters():
        assert p.abs().max() <= 1e-3 and p.std() > 1e-4, name
    params = dict(norm.named_parameters())
    assert all(bool((p == 1).all()) for n, p in params.items() if n.endswith("norm.weight"))
    w = params["model.layers.0.mlp.down_proj.weight"]
    assert 0.015 < float(w.std()) < 0.025


@pytest.mark.parametrize("extra", [{"dummy_init": "zeros"}, {"other": 1}, "normal"])
def test_model_loader_extra_config_rejected(tmp_path, extra) -> None:
    path = _save_tiny(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="model_loader_extra_config"):
        EngineArgs(model=path, device="cpu", load_format="dummy",
                   model_loader_extra_config=extra).create_engine_config()
