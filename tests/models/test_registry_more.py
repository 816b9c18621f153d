"""The registry's architecture table, the docs that show it, the unsupported-architecture
message, and the benchmark dummy shapes of the new architectures."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, write_dummy_model
from pagedllm.models.registry import ARCHITECTURES, architectures_table, get_model_class

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "models.md")


def test_docs_show_the_registry_table() -> None:
    with open(DOCS) as f:
        assert architectures_table() in f.read()


def test_unsupported_architecture_is_one_line_listing_all() -> None:
    cfg = transformers.PretrainedConfig(architectures=["RwkvForCausalLM"])
    with pytest.raises(ValueError) as e:
        get_model_class(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "RwkvForCausalLM" in msg
    assert all(arch in msg for arch in ARCHITECTURES)


@pytest.mark.parametrize("name,arch,billions", [
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.5), ("mixtral-8x7b", "MixtralForCausalLM",
                                                     46.7),
    ("gemma-3-12b", "Gemma3ForCausalLM", 11.8)])
def test_dummy_shapes_build(name: str, arch: str, billions: float, tmp_path) -> None:
    """The `pagedllm bench --dummy` shapes are the real models' (parameter count), built
    on the meta device (no memory)."""
    assert name in DUMMY_CONFIGS
    cfg = transformers.AutoConfig.from_pretrained(write_dummy_model(name, str(tmp_path)))
    cls = get_model_class(cfg)
    assert cls.__name__ == arch
    with torch.device("meta"):
        model = cls(cfg, TorchReferenceBackend())
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(n - billions) < 0.1, n
