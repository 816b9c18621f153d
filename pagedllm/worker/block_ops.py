"""Block moves the scheduler orders, applied to the KV tensors before a step's forward.

```
 swap_out  [(gpu block, cpu block)]   GPU KV -> CPU swap space   (a swapped-out request)
 swap_in   [(cpu block, gpu block)]   CPU swap space -> GPU KV   (it resumes)
 copies    [(src block, dst block)]   GPU -> GPU                 (copy-on-write)
```

The prefix cache's host tier (``kv_offload_bytes``, core/offload_tier.py) adds two::

 kv_offload [(gpu block, host slot)]  GPU KV -> host pool   (an evicted cached block)
 kv_load    [(host slot, gpu block)]  host pool -> GPU KV   (a prefix hit on the host)

and its disk tier (``kv_offload_disk_bytes``, core/disk_tier.py; worker/disk_pool.py)
two more, between the host pool and a memory-mapped file::

 kv_disk_save [(host slot, disk slot)]  host pool -> disk  (a key the host evicts)
 kv_disk_load [(disk slot, host slot)]  disk -> host pool  (a prefix hit on disk, which
                                                            kv_load then reads)

Order matters and is fixed: first wait for the last step's loads (below), then
everything that reads GPU blocks into host memory (swap-outs, then -- after the disk
moves: saves read host slots before anything of this step writes them, then disk loads
write them -- offloads: those GPU blocks may have been handed to someone else this very
step), then everything that writes GPU blocks from host memory (swap-ins, then loads: a
block offloaded and looked up again in one step round-trips), then copies -- all before
the forward writes any new KV.  The disk moves are synchronous CPU copies; they first
land (waiting) the earlier offloads into the host slots they touch.

Loads overlap the forward.  The scheduler never lets a step read or write a block whose
load it issues (the request waits a step, core/offload_tier.py), so on CUDA the loads go
out on a copy stream of their own, after the work queued so far (the step's offloads
read their destinations' old KV first), and record an event; the *next* step's block
moves and forward wait for that event on the compute stream -- a GPU-side wait, no host
sync.  The host pool is pinned and the load's gather goes into pinned staging, so the
copy is truly asynchronous.  Swap-ins and copies stay on the compute stream, ordered
before the forward.

Offloads overlap the forward too.  The gather of the evicted blocks runs on the compute
stream, before the forward (an offloaded block's new owner writes it in this step); the
device-to-host copy of the gathered blocks into pinned staging runs on the copy stream,
and the staging is scattered into the host pool once its event has completed -- at a
later step's ``apply``, without waiting -- or at once, waiting, when a load of this step
reads one of its slots (a block offloaded and looked up again before it landed).
Pending offloads land in issue order, so a slot reused for a newer block ends with the
newer bytes.  Nothing else reads the host pool.  On the CPU every move is synchronous,
on the same code path with no streams (an offload lands within its ``apply``).

Each move is one gather and one scatter per layer (``index_select`` +
``index_copy_`` over the block dimension of ``[2 | 1, num_blocks, block_size, heads, dim]``),
whatever the number of blocks: no Python loop over blocks.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.worker.disk_pool import DiskPool

logger = logging.getLogger(__name__)


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 caches as bytes: index_select / index_copy_ have no fp8 kernels on the CPU."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def move_blocks(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                pairs: Sequence[tuple[int, int]]) -> None:
    """``dst[layer][:, d] = src[layer][:, s]`` for every ``(s, d)`` in ``pairs``, on the
    current stream.

    ``src`` and ``dst`` may live on different devices (swap, the host tier) or be the same
    tensors (copy-on-write: all sources are read before any destination is written, so a
    block that is both is read first).  Destinations must be distinct.  Host -> GPU:
    ``src`` is read now, into pinned staging, and the copy runs asynchronously (the
    caching host allocator keeps the staging alive until it lands).  GPU -> host: the
    copy waits for the current stream (the caller's order is kept)."""
    if not pairs:
        return
    s_ids = [p[0] for p in pairs]
    d_ids = [p[1] for p in pairs]
    s_idx = _index(s_ids, src[0].device)
    d_idx = _index(d_ids, dst[0].device)
    for s, d in zip(src, dst):
        s, d = _bytes(s), _bytes(d)
        if s.device.type == "cpu" and d.device.type == "cuda":
            shape = (s.shape[0], len(s_ids), *s.shape[2:])
            staged = torch.empty(shape, dtype=s.dtype, pin_memory=True)
            torch.index_select(s, 1, s_idx, out=staged)
            blocks = staged.to(d.device, non_blocking=True)
        else:
            # GPU -> host lands in pageable memory first and is then scattered.
            blocks = s.index_select(1, s_idx).to(d.device)
        d.index_copy_(1, d_idx, blocks)


@dataclass
class _PendingOffload:
    """An offload whose device-to-host copy may still be running: per layer the gathered
    device blocks (held so that their memory is not reused while the copy reads it) and
    their pinned host staging, the host slots they go to, and the copy's event (None:
    already complete)."""

    gathered: list[torch.Tensor]
    staged: list[torch.Tensor]
    slots: frozenset[int]
    slot_idx: torch.Tensor
    done: torch.cuda.Event | None


class BlockOps:
    """The runner's handle on the KV tensors for block moves.

    ``kv_caches``: one GPU (or CPU) tensor per layer; ``swap_caches``: the same shapes
    with the swap space's block count, on the CPU (pinned when the KV is on a GPU), or
    empty when swapping is off; ``offload_caches``: likewise with the prefix cache's
    host pool's block count, or empty when the host tier is off; ``disk_pool``: the
    disk tier's file behind that host pool, or None.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor],
                 swap_caches: Sequence[torch.Tensor] = (),
                 offload_caches: Sequence[torch.Tensor] = (),
                 disk_pool: DiskPool | None = None) -> None:
        self.kv_caches = list(kv_caches)
        self.swap_caches = list(swap_caches)
        self.offload_caches = list(offload_caches)
        self.disk_pool = disk_pool
        self.device = self.kv_caches[0].device if self.kv_caches else torch.device("cpu")
        # The host tier's loads run here, overlapping the forward (CUDA only).
        self._load_stream = torch.cuda.Stream(self.device) \
            if self.device.type == "cuda" and self.offload_caches else None
        # Recorded after the last step's loads; the next step waits for it.
        self._loads_done: torch.cuda.Event | None = None
        # Offloads copied to pinned staging but not yet scattered into the host pool.
        self._pending: deque[_PendingOffload] = deque()

    def apply(self, sched: SchedulerOutput) -> None:
        """Wait for the last step's loads, then perform this step's swap-outs, (issue)
        offloads, land the pending offloads that are done or that this step's loads read,
        then swap-ins, (issue) loads and copy-on-write copies, in that order (the module
        doc says why).  Called before every forward, also one with no moves."""
        if (sched.swap_out or sched.swap_in) and not self.swap_caches:
            raise RuntimeError("the scheduler swapped blocks but no swap space exists")
        if (sched.kv_offload or sched.kv_load) and not self.offload_caches:
            raise RuntimeError("the scheduler moved blocks to the host tier but no host "
                               "pool exists")
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None
        move_blocks(self.kv_caches, self.swap_caches, sched.swap_out)
        if sched.kv_disk_save or sched.kv_disk_load:
            self._disk_moves(sched.kv_disk_save, sched.kv_disk_load)
        self._offload(sched.kv_offload)
        self._land_offloads({slot for slot, _ in sched.kv_load})
        move_blocks(self.swap_caches, self.kv_caches, sched.swap_in)
        self._load(sched.kv_load)
        move_blocks(self.kv_caches, self.kv_caches, sched.block_copies)

    def _disk_moves(self, save: Sequence[tuple[int, int]],
                    load: Sequence[tuple[int, int]]) -> None:
        """The disk tier's moves, synchronously: land the earlier steps' offloads into
        the host slots they read or write, then saves (host -> disk), then disk loads
        (disk -> host; this step's ``kv_load`` reads those slots)."""
        if self.disk_pool is None or not self.offload_caches:
            raise RuntimeError("the scheduler moved blocks to the disk tier but no disk "
                               "pool exists")
        self._land_offloads({s for s, _ in save} | {s for _, s in load})
        self.disk_pool.save(self.offload_caches, save)
        self.disk_pool.load(self.offload_caches, load)

    def _offload(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Issue the host tier's offloads (module doc): gather on the compute stream now;
        on CUDA copy to pinned staging on the copy stream (queued as pending), on the CPU
        the gathered blocks are the staging (pending and complete)."""
        if not pairs:
            return
        src_idx = _index([p[0] for p in pairs], self.device)
        slot_ids = [p[1] for p in pairs]
        gathered = [_bytes(k).index_select(1, src_idx) for k in self.kv_caches]
        stream = self._load_stream
        done = None
        staged = gathered
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                          for g in gathered]
                for h, g in zip(staged, gathered):
                    h.copy_(g, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        self._pending.append(_PendingOffload(gathered, staged, frozenset(slot_ids),
                                             torch.tensor(slot_ids, dtype=torch.int64),
                                             done))

    def _land_offloads(self, needed: set[int]) -> None:
        """Scatter pending offloads into the host pool, oldest first: every one whose
        copy has completed, and -- waiting for it -- every one up to the last that
        writes a slot in ``needed`` (this step's loads read them)."""
        pending = self._pending
        last = max((i for i, p in enumerate(pending) if needed & p.slots), default=-1)
        i = 0
        while pending:
            p = pending[0]
            if p.done is not None:
                if i <= last:
                    p.done.synchronize()
                elif not p.done.query():
                    break
            for host, h in zip(self.offload_caches, p.staged):
                _bytes(host).index_copy_(1, p.slot_idx, h)
            pending.popleft()
            i += 1

    def _load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Issue the host tier's loads: on the copy stream when there is one (after the
        work queued so far: earlier forwards and this step's offloads may read or write
        their destinations), with an event for the next step; else synchronously."""
        stream = self._load_stream
        if stream is None or not pairs:
            move_blocks(self.offload_caches, self.kv_caches, pairs)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Everything allocated here belongs to the copy stream's pool: reused only
        # after the copy, in that stream's order.
        with torch.cuda.stream(stream):
            move_blocks(self.offload_caches, self.kv_caches, pairs)
            done = torch.cuda.Event()
            done.record(stream)
        self._loads_done = done


def allocate_swap_space(num_blocks: int, like: torch.Tensor,
                        num_layers: int) -> list[torch.Tensor]:
    """CPU tensors for ``num_blocks`` swapped blocks per layer, shaped like ``like`` (a
    layer's KV tensor: its leading dimension is 2 for GQA, 1 for MLA).  Pinned when the
    KV lives on a GPU, so copies run at full PCIe bandwidth; plain memory when the
    "device" is the CPU itself."""
    shape = (like.shape[0], num_blocks, *like.shape[2:])
    if like.device.type != "cuda":
        return [torch.zeros(shape, dtype=like.dtype) for _ in range(num_layers)]
    return [_pinned_zeros(shape, like.dtype) for _ in range(num_layers)]


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed host memory pinned in place by ``cudaHostRegister``.  Not ``pin_memory=True``:
    torch's caching host allocator rounds every allocation up to a power of two, so a
    2.5 GiB layer of an 80 GiB host tier pins 4 GiB (128 GiB for 32 layers: an H100
    machine's OOM killer took W6's "on" run, 2026-12-05).  Unregistered when the tensor
    is collected.  Where registration fails (a locked-memory limit), the pool stays
    pageable: copies still work, synchronously."""
    t = torch.zeros(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        logger.warning("could not pin %.2f GiB of host KV blocks (cudaHostRegister: %s); "
                       "their copies will be synchronous", nbytes / 2**30, err)
        return t
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t
