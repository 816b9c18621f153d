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
The last decoder layer's modules after attention (``o_proj``, ``gate_up_proj``,
``down_proj``) read ``LoRAMapping.last_slots`` instead: with the model's ``last_only``
pruning they run on one row per request (``models/llama.py``), so that map holds one
slot per request on such steps (the token map otherwise).

The kernels' oracle is :func:`lora_ref`: dense over all slots with a per-token mask --
no loop over tokens or adapters, no host sync.  The CPU path is its GEMM form
:func:`lora_dense_` (the expand per shard: no multiplies by ``Bt``'s zero blocks).  On
CUDA the path
depends on the row count only (:func:`lora_path`): up to ``FUSED_MAX_ROWS`` rows the
one-launch ``kernels/lora.lora_fused``; above, up to ``MASKED_MAX_ROWS``
(512 by default: a large batch's decode steps) the two-launch masked form
(``kernels/lora_masked.py``: a
split-K shrink writing each row's slot columns, zeros elsewhere, then one cuBLAS
``addmm_`` over all slots), past it the dense masked form on cuBLAS (:func:`lora_dense_`,
2 + S launches).  (A segmented punica-style "sgmv" form, rows grouped by slot on the
host, lost to the masked and cuBLAS forms at the step sizes that matter on the H200
(figures at ``FUSED_MAX_ROWS``) and was never on by default; removed, git has it.)

Where a layer runs as the batch-1 GEMV (one row, ``layers/linear.gemv_applies``: decode
at batch 1) the delta rides on the base kernels instead, so an adapter adds at most one
launch per projection (:meth:`LoRALinear.gemv`, :meth:`LoRALinear.gemv_lora`): the
shrink is one split-K launch (``kernels/lora.lora_shrink``; for ``down_proj`` reading
``silu(gate) * up`` as its GEMV does), or none for ``qkv_proj`` / ``gate_up_proj``,
whose RMSNorm computes it in its own launch (:meth:`LoRALinear.norm`,
``kernels/lora_norm.py``; the manager links the norms, ``manager.link_norms``); the
expand is in the base GEMV's epilogue (``kernels/gemv.py``, and ``kernels/gemv_rope.py``
for the QKV GEMV that rotates q/k and writes the KV cache: the delta joins before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.worker.lora.peft import LoRAWeights

if TYPE_CHECKING:
    from pagedllm.kernels.gemv import GemvLoRA

class SlotMap:
    """One row -> slot map on the device (``slots``, -1: no adapter).  A persistent
    buffer: CUDA graphs read it at replay."""

    def __init__(self, max_rows: int, n_slots: int, device: torch.device) -> None:
        self.n_slots = n_slots
        self.slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        self._prev = 0  # rows the last publish set

    def publish(self, slots: np.ndarray, h2d, name: str) -> None:
        """Copy a step's map in (staged host copies, no sync); rows past it that a
        padded graph may read get -1."""
        n = len(slots)
        self.slots[:n].copy_(h2d(f"{name}_slots", slots), non_blocking=True)
        if self._prev > n:
            self.slots[n:self._prev].fill_(-1)
        self._prev = n


class LoRAMapping:
    """The step's row -> slot maps, shared by every LoRA layer of a model: ``tokens``
    (one row per scheduled token) and ``last`` (the last layer's rows after attention:
    one per request on steps the model prunes to each request's last token, else the
    token map).  ``active`` is False in an eager step where no request has an adapter
    (layers then skip the LoRA work entirely); graph capture sets it True.
    ``counters``: the masked shrink's split-K counters (``kernels/lora_masked.py``),
    zero between launches, shared by the layers (their launches are sequential)."""

    def __init__(self, max_tokens: int, device: torch.device, n_slots: int = 1) -> None:
        self.tokens = SlotMap(max_tokens, n_slots, device)
        self.last = SlotMap(max_tokens, n_slots, device)
        self.active = False
        self.counters = torch.zeros(1024, dtype=torch.int32, device=device)  # N_COUNTERS

    @property
    def token_slots(self) -> torch.Tensor:
        return self.tokens.slots

    @property
    def last_slots(self) -> torch.Tensor:
        return self.last.slots


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


def lora_dense_(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                bts: list[torch.Tensor], slot_ids: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
    """``y += lora_ref(x, slots, a, bt)`` in place, in ``y``'s dtype: one shrink GEMM
    over all slots, one masking launch, then one expand GEMM *per shard* accumulated
    into that shard's columns of ``y`` (cuBLAS ``addmm_`` on the column slice).

    ``bts[i] [L*R, n_i]``: shard ``i``'s diagonal block of every slot's ``Bt`` (rows
    ``slot*R .. slot*R+R``), outputs ``sum(n_i)`` in shard order; ``slot_ids``: ``arange
    (L)`` (int32, on the device).  Why per shard: ``Bt`` is block-diagonal over a fused
    layer's shards, so one expand over ``L*S*R`` rows would multiply ``(S-1)/S`` zeros
    (2/3 of qkv's expand, 1/2 of gate_up's); the masked shrink is re-laid out
    ``[T, S, L, R]`` by the masking launch itself, so each shard's operand is a strided
    view.  No host sync; shapes depend on ``x`` only (graph-safe)."""
    n_slots, sr, k = a.shape
    n_shards, m = len(bts), x.shape[0]
    r = sr // n_shards
    shrunk = (x @ a.reshape(n_slots * sr, k).t()).view(m, n_slots, n_shards, r)
    keep = (slots.unsqueeze(1) == slot_ids.unsqueeze(0)).view(m, n_slots, 1, 1)
    s = torch.empty(m, n_shards, n_slots, r, dtype=shrunk.dtype, device=x.device)
    torch.mul(shrunk, keep, out=s.transpose(1, 2))
    lo = 0
    for i, bt_i in enumerate(bts):  # S <= 3 launches, not a loop over tokens
        hi = lo + bt_i.shape[1]
        y[:, lo:hi].addmm_(s[:, i].reshape(m, n_slots * r), bt_i)
        lo = hi
    return y


def diag_blocks(bt: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """``bt [L, S*R, N]`` (block-diagonal over shards of ``sizes``) -> the compact
    ``[L*R, n_i]`` blocks :func:`lora_dense_` expands with (copies)."""
    n_slots, sr, _ = bt.shape
    r, lo, out = sr // len(sizes), 0, []
    for i, size in enumerate(sizes):
        out.append(bt[:, i * r:(i + 1) * r, lo:lo + size].reshape(n_slots * r, size))
        lo += size
    return out


# Row-count thresholds of the CUDA paths (see the module doc), from
# ``benchmarks/lora_probe.py`` (in git history) and W1 on an H200 (docs/findings.md,
# runs 17-19).  Per decoder layer at the Llama-3-8B shapes (4 projections, 8 slots, rank
# 16): the fused kernel wins at 1 row (42 vs 68 us for the dense form); at 256 rows the
# masked two-launch form (kernels/lora_masked.py, split-K shrink: the A reads spread
# over the GPU) adds 73 us, the dense cuBLAS form 102, sgmv 203; at 2,048 rows dense
# 194, masked 219; at 8,192 dense 696, masked 780, sgmv 656.  W1 over 8 adapters (base
# 8,625): masked up to 512 rows 7,390 tok/s, dense above 4 rows 7,007 (run 19); masked
# for every size 6,426 (run 18; its large prefill chunks).  So: fused, then masked up to
# 512 rows (decode steps of a large batch), then dense.  (Tests patch these constants to
# reach every path at small sizes.)
FUSED_MAX_ROWS = 4
MASKED_MAX_ROWS = 512


def lora_path(rows: int, use_triton: bool) -> str:
    """``"fused"``, ``"masked"``, ``"dense"`` (cuBLAS) or ``"ref"`` (the
    CPU): a function of the row count only, so graph capture and eager runs of one size
    agree."""
    if not use_triton:
        return "ref"
    if rows <= FUSED_MAX_ROWS:
        return "fused"
    return "masked" if rows <= MASKED_MAX_ROWS else "dense"


class LoRALinear:
    """The LoRA slots of one ``LinearBase`` (set as ``layer.lora``; the layer calls
    :meth:`apply` on its output).  Contract: ``apply(x, y)`` adds every row's adapter
    delta to ``y`` in place and returns it; no host sync.  ``last_rows``: the layer runs
    on the last decoder layer's pruned rows (it reads ``mapping.last_slots``)."""

    def __init__(self, layer: torch.nn.Module, max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype, device: torch.device,
                 use_triton: bool, last_rows: bool = False) -> None:
        self.layer = layer
        self.mapping = mapping
        self.max_rank = max_rank
        self.last_rows = last_rows
        self.row_parallel = hasattr(layer, "input_sizes")
        sizes = list(layer.output_partition_sizes)
        n_shards = len(sizes)
        # Where shards 1.. start among this rank's output features (kernels/lora.py).
        self.shard_bounds = tuple(sum(sizes[:i + 1]) for i in range(n_shards - 1))
        k, n = layer.in_per_partition, layer.out_per_partition
        self.a = torch.zeros(max_loras, n_shards * max_rank, k, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, n_shards * max_rank, n, dtype=dtype,
                              device=device)
        self.use_triton = use_triton
        self.slot_ids = torch.arange(max_loras, dtype=torch.int32, device=device)
        # lora_dense_'s expand operands: each shard's diagonal block of every slot's Bt,
        # compact (a copy for fused layers; a view of ``bt`` for one shard).
        if n_shards == 1:
            self.bts = [self.bt.view(max_loras * max_rank, n)]
        else:
            self.bts = [torch.zeros(max_loras * max_rank, size, dtype=dtype, device=device)
                        for size in sizes]
        # The shrink a norm computed for its output (:meth:`norm`), until read.
        self._pending: tuple[torch.Tensor, GemvLoRA] | None = None

    @staticmethod
    def bytes_per_slot(layer: torch.nn.Module, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes one adapter slot takes on ``layer`` (A and Bt)."""
        n_shards = len(layer.output_partition_sizes)
        rows = n_shards * max_rank
        compact = max_rank * layer.out_per_partition if n_shards > 1 else 0  # ``bts``
        return (rows * (layer.in_per_partition + layer.out_per_partition) + compact) \
            * dtype.itemsize

    def set_slot(self, slot: int, shards: list[LoRAWeights | None] | None) -> None:
        """Write one adapter's weights for this layer into ``slot`` (None: the adapter
        leaves the layer alone, so the slot holds zeros)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if shards is None:
            self._copy_blocks(slot)
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
        self._copy_blocks(slot)

    def _copy_blocks(self, slot: int) -> None:
        """Refresh ``bts`` (lora_dense_'s compact expand blocks) from ``bt[slot]``."""
        if len(self.bts) == 1:
            return  # a view of bt
        r = self.max_rank
        sizes = tuple(b.shape[1] for b in self.bts)
        for dst, src in zip(self.bts, diag_blocks(self.bt[slot:slot + 1], sizes)):
            dst[slot * r:(slot + 1) * r].copy_(src)

    def _map(self) -> SlotMap:
        return self.mapping.last if self.last_rows else self.mapping.tokens

    def _slots(self, rows: int) -> torch.Tensor:
        return self._map().slots[:rows]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.mapping.active:
            return y
        slots = self._slots(x.shape[0])
        path = lora_path(x.shape[0], self.use_triton)
        if path == "fused":
            from pagedllm.kernels.lora import lora_fused

            return lora_fused(x, slots, self.a, self.bt, self.shard_bounds, y=y)
        if path == "masked":
            from pagedllm.kernels.lora_masked import lora_masked_

            return lora_masked_(x, slots, self.a, self.bt, self.mapping.counters, y)
        return lora_dense_(x, slots, self.a, self.bts, self.slot_ids, y)  # dense, ref

    def gemv_lora(self, x: torch.Tensor, silu_mul: bool = False) -> GemvLoRA | None:
        """For a batch-1 GEMV of this layer (``x [1, K]``; ``[1, 2K]`` read as
        ``silu(gate) * up`` with ``silu_mul``) that adds the delta in its epilogue: runs
        the shrink (``kernels/lora.lora_shrink``, one launch) and returns the epilogue's
        operands; None when no adapter runs this step (the GEMV is then the plain one)."""
        pending, self._pending = self._pending, None
        if not self.mapping.active:
            return None
        if pending is not None and pending[0] is x:  # the norm before ran the shrink
            return pending[1]
        from pagedllm.kernels.lora import lora_shrink

        return lora_shrink(x, self._slots(1), self.a, self.bt, self.shard_bounds, silu_mul)

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The RMSNorm whose output this layer reads (``layers/norm.RMSNorm`` with
        ``lora_next`` set), with this layer's shrink in the same launch
        (``kernels/lora_norm.py``), where this layer then runs as the batch-1 GEMV; the
        shrink is kept for :meth:`gemv_lora` of that very output tensor (any other input
        runs its own shrink).  None where it does not apply: the caller runs its norm."""
        if not self.mapping.active or x.dim() != 2 or x.shape[0] != 1 \
                or not x.is_contiguous() \
                or (residual is not None and not residual.is_contiguous()):
            return None
        from pagedllm.layers.linear import gemv_applies

        if not gemv_applies(x, self.layer):  # the output has x's shape, dtype, device
            return None
        from pagedllm.kernels.lora_norm import rms_norm_shrink

        result, lora = rms_norm_shrink(x, residual, weight, eps, self._slots(1), self.a,
                                       self.bt, self.shard_bounds)
        self._pending = (result if residual is None else result[0], lora)
        return result

    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None,
             silu_mul: bool = False) -> torch.Tensor:
        """The layer's batch-1 GEMV (``kernels/gemv.py``, where ``layers/linear.
        gemv_applies``) with the delta in its epilogue: the shrink plus the base GEMV,
        two launches.  Same contract as :meth:`apply` on the GEMV's output."""
        from pagedllm.kernels.gemv import gemv

        return gemv(x, self.layer.weight, bias, silu_mul=silu_mul,
                    lora=self.gemv_lora(x, silu_mul))
