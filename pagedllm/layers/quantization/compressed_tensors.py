"""Checkpoints written by compressed-tensors (llmcompressor's format):
``quantization_config.quant_method == "compressed-tensors"``.

```
 quantization_config
   format          "float-quantized" (FP8), "pack-quantized" / "int-quantized" /
                   "naive-quantized" (ints); a group may override it with its own "format"
   config_groups   {"group_0": {"targets": ["Linear"],
                                "weights": {num_bits, type, strategy, ...},
                                "input_activations": {... "dynamic": true} | null}}
   ignore          ["lm_head", "re:.*mlp.gate$", ...]
   kv_cache_scheme {num_bits: 8, type: "float", strategy: "tensor"} | null
```

A linear layer gets the scheme of the first group whose ``targets`` match it (a class
name -- every pagedllm linear layer is a ``Linear`` -- a module name, or a ``re:``
pattern); layers in ``ignore`` and those no group targets stay unquantised.  A fused
layer (``qkv_proj``, ``gate_up_proj``) is matched through its checkpoint parts
(``q_proj`` ...), which must agree.

Dispatch by scheme: float 8-bit weights (``FP8_DYNAMIC``, ``FP8``; per channel or per
tensor, static or dynamic activations) run on ``fp8.Fp8LinearMethod``; integer schemes
go to ``compressed_tensors_int.make_int_method(scheme)`` (imported when first needed).
The checkpoint's ``k_scale`` / ``v_scale`` (``kv_cache_scheme``) are loaded by the model
loader for ``kv_cache_dtype="fp8"``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, kernel_label
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
          "gate_up_proj": ("gate_proj", "up_proj")}
# What this module runs itself; int schemes are listed by compressed_tensors_int.
_FLOAT_SCHEMES = "float 8-bit weights (FP8, FP8_DYNAMIC: channel or tensor strategy)"


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(vars(qc))


def _parts(prefix: str) -> list[str]:
    """The checkpoint module names a (possibly fused) layer stands for."""
    for fused, pieces in _FUSED.items():
        if prefix.endswith("." + fused) or prefix == fused:
            base = prefix[:-len(fused)]
            return [base + p for p in pieces]
    return [prefix]


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


def _scheme_label(scheme: dict[str, Any]) -> str:
    w = scheme.get("weights") or {}
    a = scheme.get("input_activations")
    label = f"weights {w.get('type')}{w.get('num_bits')}/{w.get('strategy')}"
    if a:
        label += f", activations {a.get('type')}{a.get('num_bits')}/{a.get('strategy')}" \
                 f"{' dynamic' if a.get('dynamic') else ' static'}"
    return label


class CompressedTensorsConfig(QuantizationConfig):
    """Per-layer schemes of a compressed-tensors checkpoint (see the module doc)."""

    name = "compressed-tensors"

    def __init__(self, groups: list[dict[str, Any]], ignore: list[str], fmt: str,
                 kv_cache_scheme: dict[str, Any] | None = None) -> None:
        self.groups = groups
        self.ignore = ignore
        self.format = fmt
        self.kv_cache_scheme = kv_cache_scheme
        self._methods: dict[int, LinearMethodBase] = {}  # one method per group
        for i, g in enumerate(groups):
            self._methods[i] = self._make_method(g)

    @classmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> CompressedTensorsConfig:
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            raise ValueError("quantization='compressed-tensors' needs a checkpoint written "
                             "by compressed-tensors (config.json has no quantization_config)")
        qc = _as_dict(qc)
        fmt = str(qc.get("format") or "dense")
        groups = []
        for name, g in (qc.get("config_groups") or {}).items():
            g = _as_dict(g)
            if not g.get("weights"):
                raise ValueError(f"compressed-tensors config group {name!r} quantises no "
                                 f"weights; supported: {_FLOAT_SCHEMES} and int schemes")
            groups.append({**g, "format": g.get("format") or fmt, "name": name})
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        ignore = [str(x) for x in (qc.get("ignore") or [])]
        return cls(groups, ignore, fmt, qc.get("kv_cache_scheme"))

    @staticmethod
    def _make_method(group: dict[str, Any]) -> LinearMethodBase:
        w = _as_dict(group["weights"])
        act = group.get("input_activations")
        act = _as_dict(act) if act else None
        if w.get("type") == "float":
            if int(w.get("num_bits", 0)) != 8 or w.get("strategy") not in (
                    "channel", "tensor", "block"):
                raise ValueError(f"compressed-tensors scheme {_scheme_label(group)} is not "
                                 f"supported; supported: {_FLOAT_SCHEMES} and int schemes")
            block = None
            if w.get("strategy") == "block":
                bs = w.get("block_structure") or [128, 128]
                block = (int(bs[0]), int(bs[1]))
            # compressed-tensors names block scales weight_scale (HF: weight_scale_inv).
            return Fp8LinearMethod(serialized=True, block_size=block,
                                   input_scale=bool(act) and not act.get("dynamic", False),
                                   block_scale_name="weight_scale")
        if w.get("type") == "int":
            try:
                from pagedllm.layers.quantization.compressed_tensors_int import (
                    make_int_method,
                )
            except ImportError:
                raise ValueError(f"compressed-tensors scheme {_scheme_label(group)} is not "
                                 f"supported; supported: {_FLOAT_SCHEMES}") from None
            return make_int_method(group)
        raise ValueError(f"compressed-tensors scheme {_scheme_label(group)} is not "
                         f"supported; supported: {_FLOAT_SCHEMES} and int schemes")

    def _group_of(self, name: str) -> int | None:
        for pat in self.ignore:
            if pat != "Linear" and _matches(name, pat):
                return None
        for i, g in enumerate(self.groups):
            if any(_matches(name, t) for t in g.get("targets") or ["Linear"]):
                return i
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if prefix.endswith("lm_head"):
            return None
        found = {self._group_of(p) for p in _parts(prefix)}
        if len(found) > 1:
            raise ValueError(f"compressed-tensors: the parts of {prefix} are quantised "
                             f"differently ({sorted(map(str, found))}); pagedllm fuses them "
                             f"into one layer")
        group = found.pop()
        return None if group is None else self._methods[group]

    def get_moe_method(self, layer: nn.Module, prefix: str) -> Any:
        """The experts' method: FP8 channel / tensor / block schemes run as
        ``fp8_moe.Fp8MoEMethod`` (block scales folded at load); ignored (or untargeted)
        experts stay unquantised; an integer scheme is a ``ValueError`` naming it.  The
        scheme is that of expert 0's projections (Qwen and Mixtral names), which must
        agree."""
        from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod

        names = [f"{prefix}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        found = {self._group_of(n) for n in names}
        if len(found) > 1:
            raise ValueError(f"compressed-tensors: the expert projections of {prefix} are "
                             f"quantised differently; pagedllm stacks them")
        group = found.pop()
        if group is None:
            return None
        method = self._methods[group]
        label = _scheme_label(self.groups[group])
        if isinstance(method, Fp8LinearMethod):
            return Fp8MoEMethod(serialized=True, input_scale=method.input_scale,
                                block_size=method.block_size,
                                block_scale_name=method.block_scale_name)
        raise ValueError(f"compressed-tensors scheme {label} is not supported for MoE "
                         f"experts ({prefix}); supported: {_FLOAT_SCHEMES}")

    def check_device(self, device: str, dtype: str) -> None:
        self._device = device
        if any(isinstance(m, Fp8LinearMethod) for m in self._methods.values()):
            from pagedllm.layers.quantization.fp8 import Fp8Config

            Fp8Config().check_device(device, dtype)
        for m in self._methods.values():
            check = getattr(m, "check_device", None)
            if check is not None:
                check(device, dtype)

    def describe_kernels(self, device: torch.device) -> str | None:
        if not any(isinstance(m, Fp8LinearMethod) for m in self._methods.values()):
            return None
        from pagedllm.layers.quantization.fp8 import Fp8Config

        return Fp8Config().describe_kernels(device)

    def describe(self) -> str:
        labels = []
        for i, g in enumerate(self.groups):
            m = self._methods[i]
            if hasattr(m, "cpu_kernel"):  # int schemes: bits, group, the kernel run
                labels.append(f"{m.describe()}; "
                              f"{kernel_label(m, getattr(self, '_device', 'cpu'))}")
            else:
                labels.append(_scheme_label(g))
        return f"compressed-tensors ({self.format}: {'; '.join(labels)})"

