"""The default method: a plain ``[out, in]`` weight in the model's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearBase, LinearMethodBase, set_weight_attrs


def gemv_shape(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x W^T`` runs as the batch-1 Triton GEMV (``kernels/gemv.py``): one row on
    CUDA in bf16/fp16.  For thin layers it reads the weight faster than cuBLAS's split-K
    kernels (H200 figures in docs/benchmarks.md).  The choice depends only on the row
    count, so a CUDA graph and an eager run of one batch size agree."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16))


def matmul(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``: the GEMV where :func:`gemv_shape`, cuBLAS otherwise."""
    if gemv_shape(x, weight):
        from pagedllm.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


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
        return matmul(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
