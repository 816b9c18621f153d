"""One linear layer's LoRA slots and the batched ``y += scale * (x A^T) B^T``.

```
 slot s (one adapter):   A[s]  [S*R, in_per_partition]     S = fused shards (q,k,v: 3)
                         Bt[s] [S*R, out_per_partition]    R = max_lora_rank
 shard i uses rows [i*R, i*R + r_i) of A[s] and Bt[s]; B is block-diagonal per shard,
 the scale is folded into Bt, unused rows are zero (they add exact zeros).
```

Tensor parallelism follows the base layer: a column-parallel layer (qkv, gate_up) keeps
the whole ``A`` and this rank's output rows of ``B`` (its shards' ``_shard_range``); a
row-parallel layer (o, down) keeps this rank's input columns of ``A`` and the whole
``B``: its partial ``x_r A_r^T`` summed over ranks is ``x A^T``, so adding the expanded
partial to the partial output *before* the all-reduce is exact (``layers/linear.py``).

The layer reads the step's token -> slot map (``LoRAMapping.token_slots``, -1: no
adapter) by its own row count only, so a CUDA graph and an eager step of one size agree.
The CPU path (and the kernels' oracle) is :func:`lora_ref`: dense over all slots with a
per-token mask -- no loop over tokens or adapters, no host sync; on the GPU, steps of up
to ``TRITON_MAX_ROWS`` rows use the Triton shrink/expand pair in ``kernels/lora.py``,
larger ones ``lora_ref`` on cuBLAS.
"""

from __future__ import annotations

import torch

from pagedllm.lora.peft import LoRAWeights


class LoRAMapping:
    """The step's token -> slot map, shared by every LoRA layer of a model.

    ``token_slots`` is a persistent device buffer (CUDA graphs read it at replay);
    ``active`` is False in an eager step where no request has an adapter (layers then
    skip the LoRA work entirely); graph capture sets it True."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.active = False


def slot_owner(n_slots: int, r: int, device: torch.device) -> torch.Tensor:
    """``[L*R]``: the slot each shrink column belongs to (for :func:`lora_ref`)."""
    return torch.arange(n_slots, dtype=torch.int32, device=device).repeat_interleave(r)


def lora_ref(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
             bt: torch.Tensor, owner: torch.Tensor | None = None) -> torch.Tensor:
    """``delta[t] = (x[t] A[slots[t]]^T) Bt[slots[t]]`` (zero where ``slots[t] < 0``).

    ``x [T, in]``, ``slots [T]``, ``a [L, R, in]``, ``bt [L, R, out]`` -> ``[T, out]``.
    Every slot's shrink is computed and the others masked out: with a few slots, two
    dense matmuls (``L*R`` is a few hundred columns) beat gathering a weight per token,
    on the CPU and for large steps on the GPU."""
    n_slots, r, k = a.shape
    if owner is None:
        owner = slot_owner(n_slots, r, x.device)
    shrunk = x @ a.reshape(n_slots * r, k).t()  # [T, L*R]
    mask = slots.to(owner.dtype).unsqueeze(1) == owner.unsqueeze(0)
    return torch.where(mask, shrunk, 0) @ bt.reshape(n_slots * r, -1)


# On CUDA, steps of up to this many rows use the Triton kernels (they read only each
# row's slot, which is what a decode step needs); larger steps use the two dense GEMMs
# of ``lora_ref`` (cuBLAS), which the per-row kernels cannot match at prefill sizes.
# The choice depends on the row count only, so graph capture and eager runs agree.
TRITON_MAX_ROWS = 256


class LoRALinear:
    """The LoRA slots of one ``LinearBase`` (set as ``layer.lora``; the layer calls
    :meth:`apply` on its output).  Contract: ``apply(x, y)`` adds every row's adapter
    delta to ``y`` in place and returns it; no host sync."""

    def __init__(self, layer: torch.nn.Module, max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype, device: torch.device,
                 use_triton: bool) -> None:
        self.layer = layer
        self.mapping = mapping
        self.max_rank = max_rank
        self.row_parallel = hasattr(layer, "input_sizes")
        n_shards = len(layer.output_partition_sizes)
        k, n = layer.in_per_partition, layer.out_per_partition
        self.a = torch.zeros(max_loras, n_shards * max_rank, k, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, n_shards * max_rank, n, dtype=dtype,
                              device=device)
        self.use_triton = use_triton
        self.owner = slot_owner(max_loras, n_shards * max_rank, device)

    def set_slot(self, slot: int, shards: list[LoRAWeights | None] | None) -> None:
        """Write one adapter's weights for this layer into ``slot`` (None: the adapter
        leaves the layer alone, so the slot holds zeros)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if shards is None:
            return
        layer, big_r = self.layer, self.max_rank
        for i, w in enumerate(shards):
            if w is None:
                continue
            a, b = w.lora_a, w.lora_b * w.scale
            rows = slice(i * big_r, i * big_r + w.rank)
            if self.row_parallel:  # this rank's input columns of A; all of B
                start = sum(layer.input_sizes[:layer.tp_rank])
                a = a[:, start:start + layer.in_per_partition]
                self.bt[slot, rows].copy_(b.t())
            else:  # all of A; this rank's output rows of B (its part of shard i)
                if len(shards) > 1 or hasattr(layer, "output_sizes"):
                    off, size, src, _ = layer._shard_range(
                        "qkv"[i] if hasattr(layer, "q_size") else i)
                else:
                    size = layer.out_per_partition
                    off, src = 0, layer.tp_rank * size
                self.bt[slot, rows, off:off + size].copy_(b[src:src + size].t())
            self.a[slot, rows].copy_(a)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.mapping.active:
            return y
        slots = self.mapping.token_slots[:x.shape[0]]
        if self.use_triton and x.shape[0] <= TRITON_MAX_ROWS:
            from pagedllm.kernels.lora import lora_expand, lora_shrink

            return lora_expand(lora_shrink(x, slots, self.a), slots, self.bt, y)
        return y.add_(lora_ref(x, slots, self.a, self.bt, self.owner).to(y.dtype))
