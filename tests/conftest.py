"""Shared fixtures: the default model's path, tokenizer, and an HF reference model."""

from __future__ import annotations

import os

import pytest

# Two CPU cores in CI: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


# Without a GPU, Triton kernels run under the interpreter.  Set before any test module
# imports triton (kernels are bound to the interpreter at import time).
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagedllm.model_files.resolve import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' own float32 model of the default GGUF, the reference of the parity
    tests.  Loaded once per session: transformers dequantises the GGUF in Python, ~17 s
    on two cores each time.  Shared, so read-only: a test that changes weights works on
    a ``copy.deepcopy`` (as ``tests/lora/fixtures.make_adapters`` does)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_path):
    """transformers' tokenizer of the default GGUF (read from the GGUF: seconds), once per
    session; shared, so read-only."""
    from transformers import AutoTokenizer

    d, f = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def llm(default_model_path):
    """One engine on the default model for the whole session (start-up is the slow part)."""
    from pagedllm import LLM

    # quantization="none": the float32 dequantised GGUF, the HF-parity path (the
    # default keeps the GGUF quantised; tests/models/test_gguf_quantised.py).
    return LLM(kv_cache_memory_bytes=64 << 20, max_model_len=1024,
               max_num_batched_tokens=256, quantization="none")
