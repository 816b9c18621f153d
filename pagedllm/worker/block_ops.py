"""Block moves the scheduler orders, applied to the KV tensors before a step's forward.

```
 swap_out  [(gpu block, cpu block)]   GPU KV -> CPU swap space   (a swapped-out request)
 swap_in   [(cpu block, gpu block)]   CPU swap space -> GPU KV   (it resumes)
 copies    [(src block, dst block)]   GPU -> GPU                 (copy-on-write)
```

The prefix cache's host tier (``kv_offload_bytes``, core/offload_tier.py) adds two::

 kv_offload [(gpu block, host slot)]  GPU KV -> host pool   (an evicted cached block)
 kv_load    [(host slot, gpu block)]  host pool -> GPU KV   (a prefix hit on the host)

Order matters and is fixed: everything that reads GPU blocks into host memory first
(swap-outs, then offloads: those GPU blocks may have been handed to someone else this
very step), then everything that writes GPU blocks from host memory (swap-ins, then
loads: a block offloaded and looked up again in one step round-trips), then copies --
all before the forward writes any new KV.  The copies run on the forward's stream,
before it, so a loaded block is valid when attention reads it; overlapping the loads
with the previous step on a copy stream is not done yet.

Each move is one gather and one scatter per layer (``index_select`` +
``index_copy_`` over the block dimension of ``[2 | 1, num_blocks, block_size, heads, dim]``),
whatever the number of blocks: no Python loop over blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.core.outputs import SchedulerOutput


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)


def move_blocks(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                pairs: Sequence[tuple[int, int]]) -> None:
    """``dst[layer][:, d] = src[layer][:, s]`` for every ``(s, d)`` in ``pairs``.

    ``src`` and ``dst`` may live on different devices (swap) or be the same tensors
    (copy-on-write: all sources are read before any destination is written, so a block
    that is both is read first).  Destinations must be distinct.
    """
    if not pairs:
        return
    s_ids = [p[0] for p in pairs]
    d_ids = [p[1] for p in pairs]
    s_idx = _index(s_ids, src[0].device)
    d_idx = _index(d_ids, dst[0].device)
    for s, d in zip(src, dst):
        blocks = s.index_select(1, s_idx)
        if blocks.device != d.device:
            # Swap-in reads pinned CPU memory, so this copy is asynchronous on CUDA;
            # swap-out lands in pageable memory first and is then scattered.
            blocks = blocks.to(d.device, non_blocking=blocks.is_pinned())
        if d.element_size() == 1 and d.is_floating_point():
            # fp8 caches: index_copy_ has no fp8 kernel on the CPU; move the bytes.
            d, blocks = d.view(torch.uint8), blocks.view(torch.uint8)
        d.index_copy_(1, d_idx, blocks)


class BlockOps:
    """The runner's handle on the KV tensors for block moves.

    ``kv_caches``: one GPU (or CPU) tensor per layer; ``swap_caches``: the same shapes
    with the swap space's block count, on the CPU (pinned when the KV is on a GPU), or
    empty when swapping is off; ``offload_caches``: likewise with the prefix cache's
    host pool's block count, or empty when the host tier is off.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor],
                 swap_caches: Sequence[torch.Tensor] = (),
                 offload_caches: Sequence[torch.Tensor] = ()) -> None:
        self.kv_caches = list(kv_caches)
        self.swap_caches = list(swap_caches)
        self.offload_caches = list(offload_caches)

    def apply(self, sched: SchedulerOutput) -> None:
        """Perform the step's swap-outs, offloads, swap-ins, loads and copy-on-write
        copies, in that order (the module doc says why)."""
        if (sched.swap_out or sched.swap_in) and not self.swap_caches:
            raise RuntimeError("the scheduler swapped blocks but no swap space exists")
        if (sched.kv_offload or sched.kv_load) and not self.offload_caches:
            raise RuntimeError("the scheduler moved blocks to the host tier but no host "
                               "pool exists")
        move_blocks(self.kv_caches, self.swap_caches, sched.swap_out)
        move_blocks(self.kv_caches, self.offload_caches, sched.kv_offload)
        move_blocks(self.swap_caches, self.kv_caches, sched.swap_in)
        move_blocks(self.offload_caches, self.kv_caches, sched.kv_load)
        move_blocks(self.kv_caches, self.kv_caches, sched.block_copies)


def allocate_swap_space(num_blocks: int, like: torch.Tensor,
                        num_layers: int) -> list[torch.Tensor]:
    """CPU tensors for ``num_blocks`` swapped blocks per layer, shaped like ``like`` (a
    layer's KV tensor: its leading dimension is 2 for GQA, 1 for MLA).  Pinned when the
    KV lives on a GPU, so copies run at full PCIe bandwidth; plain memory when the
    "device" is the CPU itself."""
    shape = (like.shape[0], num_blocks, *like.shape[2:])
    pin = like.device.type == "cuda"
    return [torch.zeros(shape, dtype=like.dtype, pin_memory=pin) for _ in range(num_layers)]
