"""W8A8-INT8 linear layers: int8 weights per output channel, activations quantised to
int8 per token on the fly (compressed-tensors ``int-quantized``, llmcompressor's W8A8).

```
 weight        int8 [N, K]       w = weight * weight_scale
 weight_scale  [N, 1] | [N]      float
 x [T, K] --amax / 127.5 per token--> x_q int8 [T, K], x_scale fp32 [T, 1]
 y = (x_q @ weight^T)_int32 * x_scale * weight_scale + bias      in the model dtype
```

The activation quantiser is compressed-tensors' own arithmetic (symmetric int8 over
``[-128, 127]``: ``scale = amax / 127.5``, ``q = clamp(round(x / scale), -128, 127)``,
a zero scale replaced by the dtype's eps), so the int8 operands are the library's.  The
GEMM accumulates exactly in int32: ``kernels.int8_gemm.int8_gemm`` on CUDA,
``torch._int_mm`` on the CPU where this torch has it, else a float64 matmul (exact for
``|sum| < 2**53``, far beyond int8 x int8 x K).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.kernels.quant_common import quantize_int8_per_token
from pagedllm.layers.quantization.base import LinearMethodBase, set_weight_attrs

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

def int8_mm_cpu(x_q: torch.Tensor, w_qt: torch.Tensor) -> torch.Tensor:
    """Exact ``x_q @ w_qt`` (``[T, K] x [K, N]`` int8) as int32 (or an integer-valued
    float64) on the CPU."""
    if _INT_MM_CPU:
        return torch._int_mm(x_q, w_qt)
    return x_q.double() @ w_qt.double()


def _int_mm_on_cpu() -> bool:
    try:
        a = torch.ones(1, 32, dtype=torch.int8)
        return int(torch._int_mm(a, torch.ones(32, 8, dtype=torch.int8))[0, 0]) == 32
    except (RuntimeError, AttributeError):
        return False


_INT_MM_CPU = _int_mm_on_cpu()


def _cuda_int8_gemm():  # type: ignore[no-untyped-def]
    """``int8_gemm(x_q, x_scale, w_q, w_scale, out_dtype)`` of the GPU kernels (its own
    module, or beside the WNA16 kernels)."""
    try:
        from pagedllm.kernels.int8_gemm import int8_gemm
    except ImportError:
        from pagedllm.kernels.wna16 import int8_gemm  # type: ignore[no-redef]
    return int8_gemm


class Int8W8A8LinearMethod(LinearMethodBase):
    """W8A8-INT8 for one linear layer (module doc)."""

    cuda_kernel = "int8_gemm"

    def describe(self) -> str:
        return "W8A8 int8 channel weights, dynamic per-token int8 activations"

    def cpu_kernel(self) -> str:
        return "torch._int_mm" if _INT_MM_CPU else "float64 matmul (exact int8 products)"

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        n = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(n, input_size_per_partition, dtype=torch.int8),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0})
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = layer.weight.data
        layer.weight_scale = nn.Parameter(layer.weight_scale.data.reshape(-1).float(),
                                          requires_grad=False)
        if not w.is_cuda:
            # torch._int_mm wants [K, N] with N contiguous: transposed once here.
            layer.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
            del layer.weight

    def dummy_init(self, layer: LinearBase, generator: torch.Generator, init: str) -> bool:
        w = layer.weight
        w.data.copy_(torch.randint(-127, 128, tuple(w.shape), generator=generator,
                                   device=w.device, dtype=torch.int32).to(torch.int8))
        amp = 1e-3 if init == "uniform" else 0.05
        layer.weight_scale.data.fill_(amp / 127.0)
        return True

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            # The same arithmetic in one Triton launch (torch's chain is eight kernels a
            # linear layer: most of a batch-1 decode step's W8A8 overhead).
            from pagedllm.kernels.int8_gemm import quant_per_token_int8

            x_q, x_s = quant_per_token_int8(x2, compressed_tensors=True)
            y = _cuda_int8_gemm()(x_q, x_s, layer.weight, layer.weight_scale, x.dtype)
        else:
            x_q, x_s = quantize_int8_per_token(x2)
            acc = int8_mm_cpu(x_q, layer.weight_t)
            y = (acc.to(torch.float64 if acc.dtype == torch.float64 else torch.float32)
                 * x_s * layer.weight_scale.view(1, -1)).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])
