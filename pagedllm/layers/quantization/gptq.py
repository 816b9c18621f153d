"""GPTQ checkpoints (``quantization_config.quant_method == "gptq"``: AutoGPTQ, GPTQModel,
optimum), run through the shared weight-only integer path (``int_linear.py``).

```
 qweight  int32 [K * bits / 32, N]   unsigned codes packed along K (dim 0), little-endian:
                                     word r holds inputs r*P .. r*P+P-1 at bits 0, bits, ...
 qzeros   int32 [K / G, N * bits / 32]  zeros packed along N the same way; the v1 format
                                     ("checkpoint_format": "gptq", the default) stores
                                     zero - 1, gptq_v2 the zero itself
 scales   fp16 [K / G, N]
 g_idx    int32 [K]                  group of input k (act-order / desc_act), else k // G
 w[n, k] = (code[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]
```

(AutoGPTQ ``qlinear_cuda_old.pack``; GPTQModel ``PackableQuantLinear.pack``.)  The
canonical layout is ``qweight`` transposed (same words), zeros unpacked (+1 for v1) and
dropped when every zero is the symmetric midpoint, and ``g_idx`` dropped when it is
``k // G``.  Supported: 4 and 8 bits, any group size dividing K (or -1: channel),
desc_act, sym or not.  ``lm_head`` quantised (``lm_head: true``) is not supported.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    kernel_label,
    set_weight_attrs,
)
from pagedllm.layers.quantization.fp8 import _name_matches
from pagedllm.layers.quantization.int_layout import IntWeight, check_bits, trivial_g_idx
from pagedllm.layers.quantization.int_layout import unpack_int32 as _unpack
from pagedllm.layers.quantization.int_linear import IntLinearMethod, cpu_kernel_name

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase


def qc_dict(hf_config: Any, method: str) -> dict[str, Any]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        raise ValueError(f"quantization={method!r} needs a {method.upper()} checkpoint "
                         "(config.json has no quantization_config)")
    return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict")
                                            else dict(vars(qc)))


def check_group(group: int, what: str) -> int | None:
    """``group_size`` of a config: None for -1 (channel-wise)."""
    if group == -1:
        return None
    if group <= 0:
        raise ValueError(f"{what}: group_size must be positive or -1, got {group}")
    return group


def row_parallel_act_order(layer: LinearBase) -> bool:
    return layer.tp_size > 1 and layer.in_per_partition != layer.input_size  # type: ignore


class GPTQLinearMethod(IntLinearMethod):
    """One GPTQ layer (module doc)."""

    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int | None, desc_act: bool, v1: bool) -> None:
        super().__init__()
        self.bits, self.group_size, self.desc_act, self.v1 = bits, group_size, desc_act, v1

    def cpu_kernel(self) -> str:
        return cpu_kernel_name(self.bits, self.group_size, self.desc_act)

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        self.init_layer(layer, params_dtype)
        if self.desc_act and row_parallel_act_order(layer):
            raise ValueError("GPTQ desc_act (act-order) checkpoints run with "
                             "tensor_parallel_size 1 only")
        n, k, p = sum(output_partition_sizes), input_size_per_partition, 32 // self.bits
        g = self.group_size or k
        if k % g or k % p or n % p:
            raise ValueError(f"{layer.prefix}: GPTQ needs input size {k} divisible by the "
                             f"group size {g} and by {p}, and output size {n} by {p}")
        grouped = self.group_size is not None
        qweight = nn.Parameter(torch.empty(k // p, n, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qweight, {"input_dim": 0, "output_dim": 1, "packed_dim": 0,
                                   "packed_factor": p})
        qzeros = nn.Parameter(torch.empty(k // g, n // p, dtype=torch.int32),
                              requires_grad=False)
        set_weight_attrs(qzeros, {"input_dim": 0 if grouped else None, "output_dim": 1,
                                  "packed_dim": 1, "packed_factor": p})
        scales = nn.Parameter(torch.empty(k // g, n, dtype=torch.float32),
                              requires_grad=False)
        set_weight_attrs(scales, {"input_dim": 0 if grouped else None, "output_dim": 1})
        g_idx = nn.Parameter(torch.empty(k, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(g_idx, {"input_dim": 0,
                                 "weight_loader": functools.partial(_load_g_idx, layer)})
        layer.gptq_g_idx_shards = set()  # type: ignore[assignment]
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("g_idx", g_idx)):
            layer.register_parameter(name, t)

    def to_int_weight(self, layer: LinearBase) -> IntWeight:
        bits, k = self.bits, layer.in_per_partition  # type: ignore[attr-defined]
        group = self.group_size or k
        qweight = layer.qweight.data.t().contiguous()  # type: ignore[union-attr]
        zeros = _unpack(layer.qzeros.data, bits, dim=1).t()  # type: ignore[union-attr]
        if self.v1:
            zeros = zeros + 1
        zeros = None if bool((zeros == 1 << (bits - 1)).all()) else zeros.float().contiguous()
        g_idx = layer.g_idx.data.to(torch.int32)  # type: ignore[union-attr]
        if not self.desc_act and g_idx.numel():
            # A row-parallel rank's slice counts groups from its own first one.
            g_idx = g_idx - g_idx.min()
        if trivial_g_idx(g_idx, group):
            g_idx = None
        elif not self.desc_act:
            raise ValueError(f"{layer.prefix}.g_idx is not k // group_size but the "
                             "config has desc_act false")
        elif int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group:
            raise ValueError(f"{layer.prefix}.g_idx: group indices outside [0, {k // group})")
        scales = layer.scales.data.t().contiguous()  # type: ignore[union-attr]
        return IntWeight(qweight, scales, zeros, g_idx, bits, group)


def _load_g_idx(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                shard_id: int | str | None = None) -> None:
    """``g_idx`` of a fused layer: the shards (q/k/v, gate/up) read the same input, so
    GPTQ gives them the same act-order; one that differs cannot share one matmul."""
    if shard_id is None:
        layer.weight_loader(param, loaded)  # type: ignore[operator]
        return
    seen: set = layer.gptq_g_idx_shards  # type: ignore[assignment]
    if seen and not torch.equal(param.data, loaded.to(param.dtype)):
        raise ValueError(f"g_idx differs from that of the other fused shards "
                         f"({sorted(map(str, seen))}) of {layer.prefix}")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)
    seen.add(shard_id)


class GPTQConfig(QuantizationConfig):
    """``quant_method: "gptq"`` (module doc)."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int | None, desc_act: bool, sym: bool,
                 v1: bool, skip: list[str]) -> None:
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.skip = skip
        self.method = GPTQLinearMethod(bits, group_size, desc_act, v1)
        self._device = "cpu"

    @classmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> GPTQConfig:
        qc = qc_dict(hf_config, "gptq")
        bits = int(qc.get("bits", 4))
        check_bits(bits, "GPTQ quantization_config.bits")
        group = check_group(int(qc.get("group_size", 128)), "GPTQ quantization_config")
        if qc.get("lm_head"):
            raise ValueError("GPTQ quantization_config.lm_head=true (a quantised lm_head) "
                             "is not supported; supported: GPTQ 4/8-bit decoder layers")
        fmt = str(qc.get("checkpoint_format") or "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; "
                             "supported: gptq, gptq_v2")
        skip = [str(m) for m in (qc.get("modules_to_not_convert") or [])]
        only = qc.get("modules_in_block_to_quantize")  # [["self_attn.q_proj", ...], ...]
        cfg = cls(bits, group, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)),
                  fmt == "gptq", skip)
        if only:
            cfg.only = [str(m) for names in only for m in
                        (names if isinstance(names, list) else [names])]
        return cfg

    #: ``modules_in_block_to_quantize`` flattened (None: every decoder linear layer)
    only: list[str] | None = None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if prefix.endswith("lm_head") or _name_matches(prefix, self.skip):
            return None
        if self.only is not None and not _name_matches(prefix, self.only):
            return None
        return self.method

    def check_device(self, device: str, dtype: str) -> None:
        self._device = device

    def describe(self) -> str:
        gs = f"group {self.group_size}" if self.group_size else "channel"
        return (f"gptq (int{self.bits} {gs}, {'sym' if self.sym else 'asym'}"
                f"{', desc_act' if self.desc_act else ''}; "
                f"{kernel_label(self.method, self._device)})")
