"""Quantisation methods of the linear layer: a registry of names, torch-free.

A method is chosen once per model at load time (``resolve_quantization``), from the
user's ``quantization=`` if given, else from the checkpoint: ``quantization_config
.quant_method`` in ``config.json``, or a GGUF file's tensor types.  Each name maps to a
``QuantizationConfig`` subclass (``base.py``) imported lazily, so that ``config.py``
(which validates the name) stays free of torch.

Adding a method: write ``layers/quantization/<name>.py`` with a ``QuantizationConfig``
subclass and its ``LinearMethodBase``, and add one line to ``QUANTIZATION_METHODS``.
Models never branch on the method; they pass ``quant_config`` and ``prefix`` to their
linear layers.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:Class" (lazy; the module imports torch).
QUANTIZATION_METHODS: dict[str, str] = {
    "awq": "pagedllm.layers.quantization.awq:AWQConfig",
    "compressed-tensors":
        "pagedllm.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "pagedllm.layers.quantization.fp8:Fp8Config",
    "gguf": "pagedllm.layers.quantization.gguf:GGUFConfig",
    "gptq": "pagedllm.layers.quantization.gptq:GPTQConfig",
}


# Methods that quantise a float checkpoint while it loads (so also a dequantised GGUF).
QUANTIZE_AT_LOAD = ("fp8",)


def quantization_names() -> list[str]:
    """Every accepted ``quantization=`` value (``"none"`` keeps the checkpoint's dtype)."""
    return ["none", *sorted(QUANTIZATION_METHODS)]


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """``quantization_config.quant_method`` of a transformers config (dict or object),
    lower-cased, or None for an unquantised checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method",
                                                                        None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method).lower() if method else None


def gguf_is_quantised(gguf_path: str) -> bool:
    """Whether a GGUF file holds any quantised 2-D tensor (not F32/F16/BF16)."""
    from pagedllm.model_files.gguf_file import GGUFFile

    return any(len(t.shape) == 2 and t.ggml_type not in (0, 1, 30)
               for t in GGUFFile(gguf_path).tensors)


def resolve_quantization(requested: str | None, hf_config: Any,
                         gguf_path: str | None = None, device: str = "cpu") -> str | None:
    """The method name to use, or None for unquantised weights.

    ``requested``: the user's ``quantization`` (None = detect).  A checkpoint that is
    quantised can only run with its own method (or one its method declares compatible,
    see ``QuantizationConfig.override_for``); anything else is a ``ValueError`` naming
    the parameter and the choices.  ``gguf_path``: the GGUF file being loaded, if any: one
    with quantised tensors runs as ``"gguf"`` (kept quantised) unless ``"none"`` asks for
    the float dequantised weights.  On ``device="cuda"`` the kept-quantised GGUF path is
    opt-in (``quantization="gguf"``): it has not yet been validated end to end on a GPU,
    so a GPU run of a GGUF dequantises as before unless asked."""
    names = quantization_names()
    if requested is not None and requested not in names:
        raise ValueError(f"quantization must be one of {', '.join(names)}, "
                         f"got {requested!r}")
    if gguf_path is not None:
        if requested in QUANTIZE_AT_LOAD:  # from the dequantised GGUF weights
            return requested
        if requested not in (None, "none", "gguf"):
            raise ValueError(f"quantization={requested!r} but the checkpoint is a GGUF file; "
                             "omit quantization, or pass 'gguf', 'none' or one of "
                             f"{', '.join(QUANTIZE_AT_LOAD)} (quantised at load)")
        if requested is None:
            return "gguf" if device == "cpu" and gguf_is_quantised(gguf_path) else None
        return None if requested == "none" else "gguf"
    if requested == "gguf":
        raise ValueError("quantization='gguf' needs a GGUF checkpoint (a .gguf file)")
    found = checkpoint_quant_method(hf_config)
    if found is not None and found not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint's quantization_config.quant_method {found!r} is "
                         f"not supported; supported: {', '.join(sorted(QUANTIZATION_METHODS))}")
    if requested is None:
        return found
    if requested == "none":
        if found is not None:
            raise ValueError(f"quantization='none' but the checkpoint is quantised with "
                             f"{found!r}; omit quantization to run it")
        return None
    if found is not None and found != requested:
        raise ValueError(f"quantization={requested!r} but the checkpoint is quantised with "
                         f"{found!r}; omit quantization or pass {found!r}")
    return requested


def get_quantization_config_class(name: str) -> type:
    """The ``QuantizationConfig`` subclass registered under ``name``."""
    try:
        module, cls = QUANTIZATION_METHODS[name].split(":")
    except KeyError:
        raise ValueError(f"quantization must be one of {', '.join(quantization_names())}, "
                         f"got {name!r}") from None
    return getattr(importlib.import_module(module), cls)
