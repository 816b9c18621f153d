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
write them -- the offloads' gathers: those GPU blocks may have been handed to someone
else this very step), then everything that writes GPU blocks from host memory
(swap-ins, then, layer by layer, the offloads' scatters into the pool and the loads
from it: a block offloaded and looked up again in one step round-trips), then copies
-- all before the forward writes any new KV.  The disk moves are synchronous CPU
copies; they first wait for the copy stream (its offloads write, its loads read, the
host slots).

Loads and offloads overlap the forward and cost the host nothing.  On CUDA the host pool
is pinned in place and mapped (``cudaHostRegister``), so the GPU addresses it directly:
a load is a GPU gather from the pool over PCIe into the device blocks, an offload a GPU
scatter from a device gather into the pool -- no staging, no CPU copy on the step's
thread (a CPU gather / scatter of the moved blocks took the H100's W6 "on" run to 1.83x
the TTFT of "off", 2026-12-05).  An offload's gather of the evicted blocks runs first on
the compute stream (their new owner writes them in this step's forward); the scatters
and loads run on a copy stream of their own, layer by layer (layer i's scatter, then
layer i's loads), so a load reads what an offload of the same step or an earlier one
wrote.  The step that issues a load also reads its blocks (the request is admitted at
once, core/offload_tier.py): each layer's loads get an event of their own, and the
attention of a layer waits for its tensor's event before touching it (``LayerLoads``,
handed to the forward as ``AttentionMetadata.kv_ready``; such a step runs eagerly, not
as a CUDA graph), so layer 0 computes while the later layers' blocks still cross PCIe
(and waits for layer 0's offloads only, not every layer's).  The *next* step's block
moves and forward wait for all of them -- GPU-side waits, no host sync.  The host
touches the pool itself only for the disk tier's moves, which first wait for the copy
stream.  Swap-ins and copies stay on the compute stream, ordered before the forward.
On the CPU every move is synchronous, on the same code path with no streams.

Each move is one gather and one scatter per layer (``index_select`` +
``index_copy_`` over the block dimension of ``[2 | 1, num_blocks, block_size, heads, dim]``,
as 8-byte words where the rows allow), whatever the number of blocks: no Python loop
over blocks.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

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


class BlockOps:
    """The runner's handle on the KV tensors for block moves.

    ``kv_caches``: one GPU (or CPU) tensor per layer; ``swap_caches``: the same shapes
    with the swap space's block count, on the CPU (pinned when the KV is on a GPU), or
    empty when swapping is off; ``offload_caches``: likewise with the prefix cache's
    host pool's block count (from :func:`allocate_swap_space`: mapped on CUDA), or
    empty when the host tier is off; ``disk_pool``: the disk tier's file behind that
    host pool, or None.
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
        cuda_tier = self.device.type == "cuda" and bool(self.offload_caches)
        # The host tier's loads and offloads run here, overlapping the forward (CUDA).
        self._load_stream = torch.cuda.Stream(self.device) if cuda_tier else None
        # The host pool as the tier's copies address it: on CUDA device tensors over the
        # same (mapped) host memory, on the CPU the pool itself.
        self._host = ([device_alias(h, self.device) for h in self.offload_caches]
                      if cuda_tier else self.offload_caches)
        # Recorded after the last step's loads; the next step waits for it.
        self._loads_done: torch.cuda.Event | None = None
        # This step's loads per KV tensor, for the forward's attention (None: no loads).
        self.step_loads: LayerLoads | None = None
        # Forwards that read this step's loads, and those of them that left a loaded
        # tensor unwaited (``check_waits``).
        self.load_steps = 0
        self.missed_waits = 0
        # Recorded after the copy stream's last move (loads and offloads, in order):
        # the disk tier's host-side copies wait for it.
        self._tier_done: torch.cuda.Event | None = None

    def apply(self, sched: SchedulerOutput) -> None:
        """Wait for the last step's loads, then perform this step's swap-outs, the disk
        tier's moves, the offloads' gathers, swap-ins, (issue) the offloads' scatters and
        the loads, layer by layer, and copy-on-write copies, in that order (the module
        doc says why).  Called before every forward, also one with no moves."""
        if (sched.swap_out or sched.swap_in) and not self.swap_caches:
            raise RuntimeError("the scheduler swapped blocks but no swap space exists")
        if (sched.kv_offload or sched.kv_load) and not self.offload_caches:
            raise RuntimeError("the scheduler moved blocks to the host tier but no host "
                               "pool exists")
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None
        self.step_loads = None
        move_blocks(self.kv_caches, self.swap_caches, sched.swap_out)
        if sched.kv_disk_save or sched.kv_disk_load:
            self._disk_moves(sched.kv_disk_save, sched.kv_disk_load)
        gathered = self._gather_offloads(sched.kv_offload)
        move_blocks(self.swap_caches, self.kv_caches, sched.swap_in)
        self._tier_copies(sched.kv_offload, gathered, sched.kv_load)
        move_blocks(self.kv_caches, self.kv_caches, sched.block_copies)

    def check_waits(self, loads: LayerLoads) -> None:
        """After a forward that read ``loads``: every loaded KV tensor should have been
        waited for by its attention layers; count (``missed_waits``) and log the steps
        where some were not (a model reading its KV outside the attention layers)."""
        missed = loads.finish()
        self.load_steps += 1
        if missed:
            self.missed_waits += 1
            if self.missed_waits == 1:
                logger.warning("%d KV tensors with host-tier loads were not waited for by "
                               "an attention layer: the model may read its KV cache "
                               "outside Attention / MultiHeadLatentAttention", missed)

    def _disk_moves(self, save: Sequence[tuple[int, int]],
                    load: Sequence[tuple[int, int]]) -> None:
        """The disk tier's moves, synchronously: wait for the copy stream (its offloads
        write host slots that saves read, its loads read slots that disk loads write),
        then saves (host -> disk), then disk loads (disk -> host; this step's
        ``kv_load`` reads those slots)."""
        if self.disk_pool is None or not self.offload_caches:
            raise RuntimeError("the scheduler moved blocks to the disk tier but no disk "
                               "pool exists")
        if self._tier_done is not None:
            self._tier_done.synchronize()
            self._tier_done = None
        self.disk_pool.save(self.offload_caches, save)
        self.disk_pool.load(self.offload_caches, load)

    def _gather_offloads(self, pairs: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """The evicted blocks' KV, gathered now on the compute stream (before anything
        of this step writes them), one tensor per layer; their scatter into the host
        pool is ``_tier_copies``'s."""
        if not pairs:
            return []
        src_idx = _index([p[0] for p in pairs], self.device)
        return [k.index_select(1, src_idx)
                for k, _ in map(_as_words, self.kv_caches, self._host)]

    def _tier_copies(self, offload: Sequence[tuple[int, int]], gathered: list[torch.Tensor],
                     load: Sequence[tuple[int, int]]) -> None:
        """Issue the host tier's copies and set ``step_loads``: layer by layer, the
        offloads' scatter into the host pool, then the loads' gather from it into the
        device blocks (after the scatter: a slot saved and looked up in one step
        round-trips), with an event per layer that has loads.  On CUDA on the copy
        stream, after the work queued so far (earlier forwards and this step's gathers
        read or write the blocks), so layer 0's loads need not wait for every layer's
        offloads; an event after all of them for the next step and the disk moves.  On
        the CPU synchronously."""
        if not offload and not load:
            return
        stream = self._load_stream
        views = [_as_words(k, h) for k, h in zip(self.kv_caches, self._host)]
        ready: dict[int, torch.cuda.Event | None] = {}
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        # On CUDA everything allocated here belongs to the copy stream's pool: reused
        # only after the copies, in that stream's order (no stream: a no-op context).
        with torch.cuda.stream(stream):
            slot_idx = _index([p[1] for p in offload], self.device) if offload else None
            s_idx = _index([p[0] for p in load], self.device) if load else None
            d_idx = _index([p[1] for p in load], self.device) if load else None
            for i, (layer, (kv, host)) in enumerate(zip(self.kv_caches, views)):
                if slot_idx is not None:
                    host.index_copy_(1, slot_idx, gathered[i])
                    if stream is not None:  # allocated on the compute stream, read here
                        gathered[i].record_stream(stream)
                if s_idx is not None:
                    kv.index_copy_(1, d_idx, host.index_select(1, s_idx))
                    ready[layer.data_ptr()] = _record(stream) if stream is not None \
                        else None
            if stream is not None:
                self._tier_done = _record(stream)
                if load:
                    self._loads_done = self._tier_done
        if load:
            self.step_loads = LayerLoads(ready)


class LayerLoads:
    """One step's host-tier loads, by destination KV tensor (its ``data_ptr``): the
    event after that tensor's copies on the copy stream (None where the copy was
    synchronous).  ``wait(kv_cache)`` -- the attention layers call it through
    ``AttentionMetadata.kv_ready`` before they touch their tensor -- makes the current
    stream wait for that event, once; ``finish`` after the forward waits for any
    tensor no layer waited for and returns how many there were (0 unless a model reads
    its KV cache outside the attention layers: a bug the runner logs)."""

    def __init__(self, ready: dict[int, torch.cuda.Event | None]) -> None:
        self._ready = ready

    def wait(self, kv_cache: torch.Tensor) -> None:
        key = kv_cache.data_ptr()
        if key in self._ready:
            event = self._ready.pop(key)
            if event is not None:
                torch.cuda.current_stream(kv_cache.device).wait_event(event)

    def finish(self) -> int:
        missed, self._ready = self._ready, {}
        for event in missed.values():
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
        return len(missed)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    done = torch.cuda.Event()
    done.record(stream)
    return done


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two KV tensors of one shape (a layer's blocks and its host pool) viewed alike: as
    8-byte words where both rows allow (fewer, wider accesses for a gather over PCIe),
    else as they are (fp8 as bytes, ``_bytes``)."""
    def ok(t: torch.Tensor) -> bool:
        return t.dim() > 2 and t.shape[-1] * t.element_size() % 8 == 0 and t.is_contiguous()

    if ok(a) and ok(b):
        return a.view(torch.int64), b.view(torch.int64)
    return _bytes(a), _bytes(b)


_INT_TYPES = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"),
              8: (torch.int64, "<i8")}


class _MappedHost:
    """The ``__cuda_array_interface__`` of a mapped host tensor (torch reads it)."""

    def __init__(self, t: torch.Tensor, typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr,
                                         "data": (t.data_ptr(), False), "strides": None,
                                         "version": 3}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the same bytes as ``host`` (contiguous, registered mapped by
    :func:`allocate_swap_space`): under unified addressing a registered host pointer is
    also its device pointer, so GPU kernels read and write the pool over PCIe.  The
    caller keeps ``host`` alive as long as the alias.  Checked once by a write through
    the alias read back on the host; RuntimeError where the GPU does not see it."""
    ints, typestr = _INT_TYPES[host.element_size()]
    raw = host.view(ints)
    why = ("kv_offload_bytes: the GPU cannot address the host pool at its host address "
           "({}); the host tier needs pinned, mapped memory under unified addressing")
    try:
        with torch.cuda.device(device):
            alias = torch.as_tensor(_MappedHost(raw, typestr), device=device)
            alias.view(-1)[:1].fill_(0x5A)
            torch.cuda.synchronize(device)
    except RuntimeError as e:  # not registered (pinning failed): torch refuses the pointer
        raise RuntimeError(why.format(str(e).splitlines()[0])) from None
    seen = int(raw.view(-1)[0])
    raw.view(-1)[0] = 0
    if seen != 0x5A:
        raise RuntimeError(why.format("a write through the alias did not reach it"))
    return alias.view(host.dtype)


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


_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: GPU kernels may address it


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed host memory pinned in place by ``cudaHostRegister``.  Not ``pin_memory=True``:
    torch's caching host allocator rounds every allocation up to a power of two, so a
    2.5 GiB layer of an 80 GiB host tier pins 4 GiB (128 GiB for 32 layers: an H100
    machine's OOM killer took W6's "on" run, 2026-12-05).  Unregistered when the tensor
    is collected.  Where registration fails (a locked-memory limit), the pool stays
    pageable: swaps still work, synchronously; the host tier's :func:`device_alias`
    then refuses it."""
    t = torch.zeros(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_MAPPED)
    if int(err) != 0:
        logger.warning("could not pin %.2f GiB of host KV blocks (cudaHostRegister: %s); "
                       "their copies will be synchronous", nbytes / 2**30, err)
        return t
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t
