"""Linear layers shaped for tensor parallelism (Megatron style).

```
 ColumnParallelLinear   W [out, in]  split on out:  rank r holds rows  [r*out/tp, (r+1)*out/tp)
                        y_r = x @ W_r^T            (outputs stay sharded)
 RowParallelLinear      W [out, in]  split on in:   rank r holds cols  [r*in/tp, (r+1)*in/tp)
                        y = all_reduce(x_r @ W_r^T) (+ bias once)    (or input_sizes shares)
 MergedColumnParallel   [gate; up] stacked on out, each shard split separately
 QKVParallelLinear      [q; k; v]  stacked on out, whole KV-head groups per rank
                        (head_partition: uneven shares, or replicated KV heads)
```

The tensor-parallel group is the one of the parallel context the layer is built in
(``distributed/parallel_state.py``); models never pass ``tp_size``/``tp_rank``.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
attribute: the model's ``load_weights`` hands it the *full* checkpoint tensor (HF layout)
and the loader copies this rank's slice into the right place of the fused parameter.
Fusing q/k/v and gate/up into one matmul each is also what makes the CPU path fast.

How the weight is stored and multiplied is the layer's ``quant_method``
(``layers/quantization/``): unquantised by default, or the method the model's
``QuantizationConfig`` picks for the layer's ``prefix``.  The method registers the
parameters; the layer shards any of them from their ``output_dim`` / ``input_dim`` /
``packed_dim`` / ``per_shard`` attributes (``layers/quantization/base.py``), so one
loader serves plain, FP8, INT4-packed and grouped-scale tensors alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator, current_parallel_state
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.unquantized import (
    UNQUANTIZED,
    UnquantizedLinearMethod,
    gemv_shape,
)


def gemv_applies(x: torch.Tensor, layer: LinearBase) -> bool:
    """Whether ``layer(x)`` runs as the batch-1 Triton GEMV (``kernels/gemv.py``; see
    ``quantization.unquantized.gemv_shape``): unquantised weights only, so fused paths
    that read the weight themselves (GEMV + SiLU, GEMV + RoPE) see a plain tensor."""
    weight = layer.unquantized_weight
    # With LoRA slots the GEMV adds the delta in its epilogue (``LoRALinear.gemv``;
    # ``LlamaAttention``'s QKV + RoPE through ``LoRALinear.gemv_lora``).
    return gemv_shape(x, weight) if weight is not None else False


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a whole tensor (shapes must match), converting dtype and device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_weight(param: torch.Tensor, loaded: torch.Tensor, *shard: object) -> None:
    """Copy a checkpoint tensor into ``param`` (no autograd) through the parameter's own
    ``weight_loader`` (sharded, fused or quantised parameters; ``shard`` names the part
    of a fused parameter) or, for a plain one, :func:`default_weight_loader`."""
    loader = getattr(param, "weight_loader", None)
    with torch.no_grad():
        if loader is None:
            default_weight_loader(param, loaded)
        else:
            loader(param, loaded, *shard)


def _copy_shard(dst: torch.Tensor, loaded: torch.Tensor, dim: int, start: int,
                total: int, what: str) -> None:
    """Copy ``loaded[start : start + dst.shape[dim]]`` along ``dim`` into ``dst``: this
    rank's slice of the full checkpoint tensor, which must be ``total`` long on ``dim``
    and match ``dst`` elsewhere (all in stored elements)."""
    size = dst.shape[dim]
    expect = list(dst.shape)
    expect[dim] = total
    if list(loaded.shape) != expect:
        raise ValueError(f"shape mismatch for {what}: parameter shard {tuple(dst.shape)} "
                         f"(offset {start}, dim {dim}) vs checkpoint "
                         f"{tuple(loaded.shape)}")
    dst.copy_(loaded.narrow(dim, start, size))


def _scaled(n: int, stored: int, logical: int, what: str) -> int:
    """``n`` logical elements in a parameter that stores ``stored`` elements for
    ``logical`` ones (packing, grouped scales)."""
    if (n * stored) % logical:
        raise ValueError(f"{what}: a shard boundary at {n} of {logical} features falls "
                         f"inside a packed element or a scale group")
    return n * stored // logical


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` contiguous sizes differing by at most one, the
    larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def head_partition(total_heads: int, total_kv_heads: int, tp_size: int,
                   ) -> list[tuple[int, int, int, int]]:
    """Per rank ``(q_start, num_heads, kv_start, num_kv_heads)``, in heads.

    Attention is split by KV head, each rank taking whole GQA groups (its KV heads and
    the query heads that read them), as evenly as possible: SmolLM2's 3 KV heads of 3
    queries each give ranks 6 and 3 query heads at ``tp_size=2``.  With fewer KV heads
    than ranks each KV head is replicated on ``tp_size / total_kv_heads`` ranks, which
    split its query heads."""
    if total_heads % total_kv_heads:
        raise ValueError(f"num_attention_heads ({total_heads}) must be a multiple of "
                         f"num_key_value_heads ({total_kv_heads})")
    group = total_heads // total_kv_heads
    if total_kv_heads >= tp_size:
        out, kv = [], 0
        for n in balanced_split(total_kv_heads, tp_size):
            out.append((kv * group, n * group, kv, n))
            kv += n
        return out
    if tp_size % total_kv_heads or total_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide num_attention_heads "
                         f"({total_heads}) and be a multiple of num_key_value_heads "
                         f"({total_kv_heads})")
    per, replicas = total_heads // tp_size, tp_size // total_kv_heads
    return [(r * per, per, r // replicas, 1) for r in range(tp_size)]


def _packed(param: torch.Tensor, dim: int, n: int) -> int:
    """``n`` logical elements along ``dim`` in stored elements of ``param``."""
    if getattr(param, "packed_dim", None) == dim:
        return n // int(param.packed_factor)  # type: ignore[attr-defined]
    return n


def tp_group(tp_size: int | None, tp_rank: int | None) -> GroupCoordinator:
    """The layer's tensor-parallel group: the one of the parallel context it is built in
    (``distributed/parallel_state.py``), or, when ``tp_size``/``tp_rank`` are given
    outright (tests of the sharded loader), a group of that shape on the default
    process group."""
    if tp_size is None and tp_rank is None:
        return current_parallel_state().tp
    size, rank = tp_size or 1, tp_rank or 0
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank {rank} out of range for tp_size {size}")
    return GroupCoordinator(tuple(range(size)), rank)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` logically ``[output_size_per_partition,
    input_size_per_partition]``, stored as ``quant_method`` decides.

    Parameters are created in the ambient default dtype/device (the loader builds the
    model under ``torch.device(...)`` and a default-dtype context), so building an 8B
    model on a GPU allocates directly there.  ``prefix`` is the layer's module name in
    the HF checkpoint (``model.layers.0.mlp.gate_up_proj``): quantisation configs pick a
    method (or none, for ignored layers) by it.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 tp_size: int | None = None, tp_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group(tp_size, tp_rank)
        self.tp_size, self.tp_rank = self.tp_group.world_size, self.tp_group.rank_in_group
        self.prefix = prefix
        # Multi-LoRA (``worker/lora/layers.LoRALinear``), set by the LoRA manager: adds each
        # row's adapter delta to the output of whatever ``quant_method`` computed.
        self.lora: Any = None
        method = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethodBase = method or UNQUANTIZED
        self.quant_method.create_weights(
            self, self.in_per_partition, self.output_partition_sizes, input_size,
            output_size, torch.get_default_dtype())
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(self.out_per_partition), requires_grad=False)
            self.bias.output_dim = 0  # type: ignore[attr-defined]
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.bias = None

    @property
    def out_per_partition(self) -> int:
        return self.output_size

    @property
    def in_per_partition(self) -> int:
        return self.input_size

    @property
    def output_partition_sizes(self) -> list[int]:
        """This rank's rows of each fused shard, in order."""
        return [self.out_per_partition]

    @property
    def unquantized_weight(self) -> torch.Tensor | None:
        """The plain ``[out, in]`` weight, or None when a quantisation method stores it
        (fused fast paths that read the weight themselves check this)."""
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            return self.weight
        return None

    @property
    def int4_segments(self) -> list[list[Any]] | None:
        """``quant_method.int4_segments`` (packed int4 parts a fused CPU path may read),
        or None when a bias or a LoRA adapter would add to the product."""
        if self.bias is not None or self.lora is not None:
            return None
        return self.quant_method.int4_segments(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, self.bias)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The base method's ``x W^T + b``, plus the LoRA delta where adapters are on (at
        batch 1 inside the GEMV's epilogue: ``LoRALinear.gemv``)."""
        if self.lora is not None and gemv_applies(x, self):
            return self.lora.gemv(x, bias)
        y = self.quant_method.apply(self, x, bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        default_weight_loader(param, loaded)

    def _shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_size: int | None = None, tp_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        n = tp_group(tp_size, tp_rank).world_size
        if output_size % n:
            raise ValueError(f"output size {output_size} not divisible by tp_size {n}")
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, quant_config,
                         prefix)

    @property
    def out_per_partition(self) -> int:
        return self.output_size // self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        dim = getattr(param, "output_dim", None)
        if shard_id is not None:
            self._load_fused_shard(param, loaded, shard_id, dim)
        elif dim is None:
            default_weight_loader(param, loaded)
        else:
            size = param.data.shape[dim]
            _copy_shard(param.data, loaded, dim, self.tp_rank * size, size * self.tp_size,
                        "column shard")

    def _shard_range(self, shard_id: int | str) -> tuple[int, int, int, int]:
        """``(offset, size, source offset, source size)`` of a fused shard: where this
        rank's rows of it sit in the parameter, and where they come from in the
        checkpoint tensor of that shard (logical rows; the caller converts for
        packing)."""
        raise ValueError(f"{type(self).__name__} has no fused shards (got {shard_id!r})")

    def _load_fused_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: int | str, dim: int | None) -> None:
        if getattr(param, "per_shard", False):  # one entry per fused shard
            param.data[self._shard_index(shard_id)].copy_(loaded.reshape(()))
            return
        if dim is None:  # replicated, identical for every shard (e.g. GPTQ's g_idx)
            default_weight_loader(param, loaded)
            return
        offset, size, src, total = self._shard_range(shard_id)
        dst = param.data.narrow(dim, _packed(param, dim, offset), _packed(param, dim, size))
        _copy_shard(dst, loaded, dim, _packed(param, dim, src), _packed(param, dim, total),
                    f"shard {shard_id!r}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj and up_proj -> gate_up_proj).  ``shard_id`` is the index into
    ``output_sizes``; each logical output is split across ranks independently so that
    rank r holds ``[gate_r; up_r]``."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp_size: int | None = None, tp_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        n = tp_group(tp_size, tp_rank).world_size
        if any(s % n for s in self.output_sizes):
            raise ValueError(f"output sizes {self.output_sizes} not divisible by "
                             f"tp_size {n}")
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size, tp_rank,
                         quant_config, prefix)

    @property
    def output_partition_sizes(self) -> list[int]:
        return [s // self.tp_size for s in self.output_sizes]

    def _shard_range(self, shard_id: int | str) -> tuple[int, int, int, int]:
        idx = int(shard_id)
        if not 0 <= idx < len(self.output_sizes):
            raise ValueError(f"merged shard_id must be in [0, {len(self.output_sizes)}), "
                             f"got {shard_id!r}")
        sizes = self.output_partition_sizes
        return sum(sizes[:idx]), sizes[idx], self.tp_rank * sizes[idx], \
            self.output_sizes[idx]


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: output ``[q | k | v]`` with this rank's
    ``num_heads * head_dim`` then twice ``num_kv_heads * head_dim`` features.
    ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``.  Heads are split by whole GQA groups,
    unevenly when the KV heads do not divide by the ranks, and KV heads are replicated
    when there are fewer of them than ranks (``head_partition``)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_size: int | None = None,
                 tp_rank: int | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        g = tp_group(tp_size, tp_rank)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.partition = head_partition(total_num_heads, total_num_kv_heads, g.world_size)
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = \
            self.partition[g.rank_in_group]
        out = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp_size, tp_rank, quant_config,
                            prefix)

    @property
    def out_per_partition(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def output_partition_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def _shard_index(self, shard_id: int | str) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return "qkv".index(str(shard_id))

    def _shard_range(self, shard_id: int | str) -> tuple[int, int, int, int]:
        idx = self._shard_index(shard_id)
        d = self.head_dim
        if idx == 0:
            return 0, self.q_size, self.q_start * d, self.total_num_heads * d
        return self.q_size + (idx - 1) * self.kv_size, self.kv_size, self.kv_start * d, \
            self.total_num_kv_heads * d


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce) and the
    bias is added once, after the reduction.  ``input_sizes``: each rank's share of the
    input features when they are not split evenly (the attention output projection
    follows ``QKVParallelLinear``'s head partition)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_size: int | None = None, tp_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 input_sizes: Sequence[int] | None = None) -> None:
        n = tp_group(tp_size, tp_rank).world_size
        if input_sizes is None:
            if input_size % n:
                raise ValueError(f"input size {input_size} not divisible by tp_size {n}")
            input_sizes = [input_size // n] * n
        if len(input_sizes) != n or sum(input_sizes) != input_size:
            raise ValueError(f"input_sizes {list(input_sizes)} must be {n} shares of "
                             f"{input_size}")
        self.input_sizes = list(input_sizes)
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, quant_config,
                         prefix)

    @property
    def in_per_partition(self) -> int:
        return self.input_sizes[self.tp_rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LoRA's partial delta (this rank's input columns of A) joins the partial output
        # before the all-reduce, which sums it into the exact delta.
        return self._reduce(self._apply(x, self._local_bias))

    def forward_gated(self, gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
        """``forward(silu(gate) * up)`` for ``gate_up = [gate | up]`` (Gemma's
        ``gelu_tanh(gate) * up`` with ``gelu_tanh``), with the activation fused into the
        GEMV's read of its input (one kernel instead of two).  Only where
        ``gemv_applies(gate_up, self)``, and for ``gelu_tanh`` without a LoRA adapter."""
        from pagedllm.kernels.gemv import gemv

        if self.lora is not None:  # the partial delta joins before the all-reduce
            return self._reduce(self.lora.gemv(gate_up, self._local_bias, silu_mul=True))
        return self._reduce(gemv(gate_up, self.weight, self._local_bias,
                                 silu_mul=not gelu_tanh, gelu_tanh_mul=gelu_tanh))

    @property
    def _local_bias(self) -> torch.Tensor | None:
        """The bias to add inside the matmul: only without tensor parallelism (with it,
        once, after the all-reduce)."""
        return self.bias if self.tp_size == 1 else None

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (and add the bias once)."""
        if self.tp_size == 1:
            return y
        self.tp_group.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias, per-tensor scales: replicated
            default_weight_loader(param, loaded)
            return
        # The parameter's own size on ``dim`` per logical input feature (packing,
        # grouped scales) converts this rank's feature offset.
        stored, local = param.data.shape[dim], self.in_per_partition
        start = _scaled(sum(self.input_sizes[:self.tp_rank]), stored, local, "row shard")
        total = _scaled(self.input_size, stored, local, "row shard")
        _copy_shard(param.data, loaded, dim, start, total, "row shard")
