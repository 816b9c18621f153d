"""Linear layers shaped for tensor parallelism (Megatron style), run at ``tp_size=1`` today.

```
 ColumnParallelLinear   W [out, in]  split on out:  rank r holds rows  [r*out/tp, (r+1)*out/tp)
                        y_r = x @ W_r^T            (outputs stay sharded)
 RowParallelLinear      W [out, in]  split on in:   rank r holds cols  [r*in/tp, (r+1)*in/tp)
                        y = all_reduce(x_r @ W_r^T) (+ bias once)
 MergedColumnParallel   [gate; up] stacked on out, each shard split separately
 QKVParallelLinear      [q; k; v]  stacked on out, heads split per rank
```

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
attribute: the model's ``load_weights`` hands it the *full* checkpoint tensor (HF layout)
and the loader copies this rank's slice into the right place of the fused parameter.
Fusing q/k/v and gate/up into one matmul each is also what makes the CPU path fast.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x W^T`` runs as the batch-1 Triton GEMV (``kernels/gemv.py``): one row on
    CUDA in bf16/fp16.  For thin layers it reads the weight faster than cuBLAS's split-K
    kernels (H200 figures in docs/benchmarks.md).  The choice depends only on the row
    count, so a CUDA graph and an eager run of one batch size agree."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16) and _gemv_enabled())


def _gemv_enabled() -> bool:
    """``PAGEDLLM_GEMV=0`` turns the GEMV off (cuBLAS everywhere), for A/B benchmarks."""
    global _GEMV
    if _GEMV is None:
        _GEMV = os.environ.get("PAGEDLLM_GEMV", "1") != "0"
    return _GEMV


_GEMV: bool | None = None


def _matmul(x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``: the GEMV where :func:`gemv_applies`, cuBLAS otherwise."""
    if gemv_applies(x, weight):
        from pagedllm.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a whole tensor (shapes must match), converting dtype and device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _copy_shard(dst: torch.Tensor, loaded: torch.Tensor, dim: int, rank: int,
                full: int, what: str) -> None:
    """Copy rank ``rank``'s slice (along ``dim``) of the full checkpoint tensor ``loaded``,
    which must be ``full`` long on ``dim`` and match ``dst`` elsewhere."""
    size = dst.shape[dim]
    expect = list(dst.shape)
    expect[dim] = full
    if list(loaded.shape) != expect:
        raise ValueError(f"shape mismatch for {what}: expected checkpoint shape "
                         f"{tuple(expect)}, got {tuple(loaded.shape)}")
    dst.copy_(loaded.narrow(dim, rank * size, size))


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W: [output_size_per_partition, input_size_per_partition]``.

    Parameters are created with ``torch.empty`` in the ambient default dtype/device (the
    loader builds the model under ``torch.device(...)`` and a default-dtype context), so
    building an 8B model on a GPU allocates directly there.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.weight = nn.Parameter(torch.empty(self.out_per_partition, self.in_per_partition),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(self.out_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.bias = None

    @property
    def out_per_partition(self) -> int:
        return self.output_size

    @property
    def in_per_partition(self) -> int:
        return self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        default_weight_loader(param, loaded)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} not divisible by tp_size {tp_size}")
        super().__init__(input_size, output_size, bias, tp_size, tp_rank)

    @property
    def out_per_partition(self) -> int:
        return self.output_size // self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        _copy_shard(param.data, loaded, 0, self.tp_rank, self.output_size, "column shard")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj and up_proj -> gate_up_proj).  ``shard_id`` is the index into
    ``output_sizes``; each logical output is split across ranks independently so that
    rank r holds ``[gate_r; up_r]``."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            super().weight_loader(param, loaded)
            return
        idx = int(shard_id)
        size = self.output_sizes[idx] // self.tp_size
        offset = sum(self.output_sizes[:idx]) // self.tp_size
        _copy_shard(param.data.narrow(0, offset, size), loaded, 0, self.tp_rank,
                    self.output_sizes[idx], f"merged shard {idx}")


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: output ``[q | k | v]`` with
    ``num_heads * head_dim`` then twice ``num_kv_heads * head_dim`` features (per rank).
    ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``.  KV heads are replicated when there are
    fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        if total_num_heads % tp_size:
            raise ValueError(f"num_attention_heads {total_num_heads} not divisible by "
                             f"tp_size {tp_size}")
        self.head_dim = head_dim
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_size, tp_rank)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is None:
            super().weight_loader(param, loaded)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
            full = self.q_size * self.tp_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
            full = self.kv_size * (self.tp_size // self.kv_replicas)
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy_shard(param.data.narrow(0, offset, size), loaded, 0, rank, full,
                    f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce) and the
    bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp_size {tp_size}")
        super().__init__(input_size, output_size, bias, tp_size, tp_rank)

    @property
    def in_per_partition(self) -> int:
        return self.input_size // self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(_matmul(x, self.weight, self._local_bias))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward(silu(gate) * up)`` for ``gate_up = [gate | up]``, with the activation
        fused into the GEMV's read of its input (one kernel instead of two).  Only where
        ``gemv_applies(gate_up, self.weight)``."""
        from pagedllm.kernels.gemv import gemv

        return self._reduce(gemv(gate_up, self.weight, self._local_bias, silu_mul=True))

    @property
    def _local_bias(self) -> torch.Tensor | None:
        """The bias to add inside the matmul: only without tensor parallelism (with it,
        once, after the all-reduce)."""
        return self.bias if self.tp_size == 1 else None

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (and add the bias once)."""
        if self.tp_size == 1:
            return y
        torch.distributed.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded)
            return
        _copy_shard(param.data, loaded, 1, self.tp_rank, self.input_size, "row shard")
