"""The default method: a plain ``[out, in]`` weight in the model's dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, set_weight_attrs

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase


class UnquantizedLinearMethod(LinearMethodBase):
    """``weight: [sum(output_partition_sizes), input_size_per_partition]``; the matmul is
    the batch-1 Triton GEMV where it applies, cuBLAS/MKL otherwise."""

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes),
                                          input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        from pagedllm.layers.linear import _matmul

        return _matmul(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
