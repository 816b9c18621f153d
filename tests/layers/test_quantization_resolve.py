"""Choosing the quantisation method: the user's ``quantization=`` against the
checkpoint's ``quantization_config`` (layers/quantization/__init__.py)."""

from __future__ import annotations

import types

import pytest

from pagedllm import LLM
from pagedllm.layers.quantization import (
    QUANTIZATION_METHODS,
    checkpoint_quant_method,
    resolve_quantization,
)


def _cfg(qc: object = None) -> object:
    return types.SimpleNamespace(quantization_config=qc)


def test_unquantised_checkpoint_defaults_to_none() -> None:
    assert resolve_quantization(None, _cfg()) is None
    assert resolve_quantization("none", _cfg()) is None


def test_unknown_name_is_a_value_error_listing_choices() -> None:
    with pytest.raises(ValueError, match=r"quantization must be one of none"):
        resolve_quantization("int3", _cfg())


def test_unsupported_checkpoint_scheme_is_named() -> None:
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        resolve_quantization(None, _cfg({"quant_method": "bitsandbytes"}))


def test_checkpoint_method_read_from_dict_or_object() -> None:
    assert checkpoint_quant_method(_cfg({"quant_method": "FP8"})) == "fp8"
    assert checkpoint_quant_method(_cfg(types.SimpleNamespace(quant_method="gptq"))) == "gptq"


def test_none_refuses_a_quantised_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(QUANTIZATION_METHODS, "fp8", "x:y")
    with pytest.raises(ValueError, match="quantization='none' but the checkpoint"):
        resolve_quantization("none", _cfg({"quant_method": "fp8"}))
    assert resolve_quantization(None, _cfg({"quant_method": "fp8"})) == "fp8"


def test_llm_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="int3", kv_cache_memory_bytes=1 << 24)
