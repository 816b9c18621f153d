"""AWQ checkpoints (``quantization_config.quant_method == "awq"``, AutoAWQ's GEMM
packing), run through the shared weight-only integer path (``int_linear.py``).

```
 qweight  int32 [K, N / 8]       4-bit codes packed along N (dim 1) in the interleaved
                                 order AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]: bits 4i..4i+3
                                 of word c hold output 8c + AWQ_ORDER[i]
 qzeros   int32 [K / G, N / 8]   zeros, packed the same way (the zero itself)
 scales   fp16 [K / G, N]
 w[n, k] = (code[k, n] - zero[k // G, n]) * scales[k // G, n]
```

(AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` and
``awq/utils/packing_utils.py`` ``dequantize_gemm``.)  Conversion to the canonical layout
unpacks with the order, transposes and repacks along K.  Supported: ``version: "gemm"``,
4 bits, ``zero_point: true``, any group dividing K.
"""

from __future__ import annotations

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
from pagedllm.layers.quantization.gptq import check_group, qc_dict
from pagedllm.layers.quantization.int_layout import IntWeight, pack_codes, unpack_int32
from pagedllm.layers.quantization.int_linear import IntLinearMethod, cpu_kernel_name

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_SUPPORTED = "AWQ GEMM (version 'gemm'), 4 bits, zero_point true"


class AWQLinearMethod(IntLinearMethod):
    """One AWQ GEMM layer (module doc)."""

    checkpoint_params = ("qweight", "qzeros", "scales")
    bits = 4

    def __init__(self, group_size: int | None) -> None:
        super().__init__()
        self.group_size = group_size

    def cpu_kernel(self) -> str:
        return cpu_kernel_name(4, self.group_size, False)

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        self.init_layer(layer, params_dtype)
        n, k = sum(output_partition_sizes), input_size_per_partition
        g = self.group_size or k
        if k % g or k % 8 or n % 8:
            raise ValueError(f"{layer.prefix}: AWQ needs input size {k} divisible by the "
                             f"group size {g} and by 8, and output size {n} by 8")
        grouped = self.group_size is not None
        qweight = nn.Parameter(torch.empty(k, n // 8, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qweight, {"input_dim": 0, "output_dim": 1, "packed_dim": 1,
                                   "packed_factor": 8})
        qzeros = nn.Parameter(torch.empty(k // g, n // 8, dtype=torch.int32),
                              requires_grad=False)
        set_weight_attrs(qzeros, {"input_dim": 0 if grouped else None, "output_dim": 1,
                                  "packed_dim": 1, "packed_factor": 8})
        scales = nn.Parameter(torch.empty(k // g, n, dtype=torch.float32),
                              requires_grad=False)
        set_weight_attrs(scales, {"input_dim": 0 if grouped else None, "output_dim": 1})
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            layer.register_parameter(name, t)

    def to_int_weight(self, layer: LinearBase) -> IntWeight:
        k = layer.in_per_partition  # type: ignore[attr-defined]
        codes = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER)  # [K/G, N]
        return IntWeight(pack_codes(codes.t(), 4), layer.scales.data.t().contiguous(),
                         zeros.t().float().contiguous(), None, 4, self.group_size or k)


class AWQConfig(QuantizationConfig):
    """``quant_method: "awq"`` (module doc)."""

    name = "awq"

    def __init__(self, group_size: int | None, skip: list[str]) -> None:
        self.group_size, self.skip = group_size, skip
        self.method = AWQLinearMethod(group_size)
        self._device = "cpu"

    @classmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> AWQConfig:
        qc = qc_dict(hf_config, "awq")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        zero_point = bool(qc.get("zero_point", True))
        if bits != 4 or version != "gemm" or not zero_point:
            raise ValueError(f"AWQ checkpoint (version {version!r}, {bits} bits, zero_point "
                             f"{zero_point}) is not supported; supported: {_SUPPORTED}")
        group = check_group(int(qc.get("group_size", qc.get("q_group_size", 128))),
                            "AWQ quantization_config")
        skip = [str(m) for m in (qc.get("modules_to_not_convert") or [])]
        return cls(group, skip)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if prefix.endswith("lm_head") or _name_matches(prefix, self.skip):
            return None
        return self.method

    def check_device(self, device: str, dtype: str) -> None:
        self._device = device

    def describe(self) -> str:
        gs = f"group {self.group_size}" if self.group_size else "channel"
        return (f"awq (int4 {gs}, zero point, GEMM packing; "
                f"{kernel_label(self.method, self._device)})")
