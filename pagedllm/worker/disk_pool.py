"""The prefix cache's disk pool (``kv_offload_disk_bytes``): a memory-mapped file of KV
blocks behind the host pool, and the two copies between them (the bookkeeping -- which
key lives in which slot, LRU -- is core/disk_tier.py's).

```
 host pool (per layer [E, slots, block_size, heads, dim], E = 2 | 1)
        save [(host slot, disk slot)]  │  ▲  load [(disk slot, host slot)]
                                       ▼  │
 file   row 0: | layer 0's block bytes | layer 1's | ... |     one row per disk slot
        row 1: | ...                                     |     (numpy.memmap, uint8)
```

A block's bytes are one contiguous row, so a save writes and a load reads one stretch of
the file per block; each move is one gather and one scatter per layer (no Python loop
over blocks).  The bytes are copied as they are (fp8 and MLA caches alike).  Pages the
kernel has not written back yet are served from its page cache; a block's row is only
ever read after the step that wrote it (core/disk_tier.py), by this process, so no
``msync`` is needed -- the file is a cache, worthless once the engine is gone.

The file lives in a private directory (``tempfile.mkdtemp`` inside
``kv_offload_disk_path``, default the system's temp directory) that ``close`` removes;
a finalizer removes it too if the pool is dropped without ``close`` (interpreter exit).
The file is reserved at full size (``posix_fallocate``: a disk that fills up later
cannot turn a save into a SIGBUS) and unlinked once mapped, so an engine that is killed
leaves no blocks on disk.
Each tensor/pipeline-parallel rank has its own file with its own share of each block.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence

import numpy as np
import torch


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, same leading dims (the last one scaled)."""
    return t.view(torch.uint8)


class DiskPool:
    """``num_blocks`` disk slots of blocks shaped like the host pool ``host`` (one tensor
    per layer, ``[E, host slots, ...]``, contiguous), in a new private directory under
    ``directory`` (None: the system's temp directory)."""

    def __init__(self, num_blocks: int, host: Sequence[torch.Tensor],
                 directory: str | None = None) -> None:
        if num_blocks < 1 or not host:
            raise ValueError("kv_offload_disk_bytes: the disk pool needs at least one "
                             "block and a host pool")
        # Each layer's share of one block row: (offset, bytes, the layer's E).
        self._layers: list[tuple[int, int, int]] = []
        off = 0
        for t in host:
            size = t[:, 0].numel() * t.element_size()
            self._layers.append((off, size, t.shape[0]))
            off += size
        self.num_blocks = num_blocks
        self.block_bytes = off  # this rank's share of one block
        self.dir = tempfile.mkdtemp(prefix="pagedllm-kv-disk-", dir=directory)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.path = os.path.join(self.dir, "kv-blocks.bin")
        try:
            with open(self.path, "wb") as f:
                # Reserved now, not sparse: a filesystem that fills up later would
                # otherwise kill the engine with SIGBUS on the first write past it.
                os.posix_fallocate(f.fileno(), 0, num_blocks * off)
            self._mm: np.memmap | None = np.memmap(self.path, dtype=np.uint8, mode="r+",
                                                   shape=(num_blocks, off))
        except OSError as e:
            self._cleanup()
            raise ValueError(f"kv_offload_disk_bytes: cannot reserve {num_blocks * off} "
                             f"bytes in {directory or tempfile.gettempdir()}: {e}") from e
        # The mapping keeps the file alive: unlinked now, a crashed or killed engine
        # leaves no blocks behind (only the empty private directory until close).
        os.unlink(self.path)
        self.rows = torch.from_numpy(self._mm)

    def save(self, host: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """``row[d] = block s of every layer of host`` for every ``(s, d)``; disk slots
        distinct."""
        if not pairs:
            return
        s_idx = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        d_idx = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        rows = torch.empty((len(pairs), self.block_bytes), dtype=torch.uint8)
        for t, (off, size, _) in zip(host, self._layers):
            blocks = _u8(t).index_select(1, s_idx)  # [E, n, ...]
            rows[:, off:off + size] = blocks.transpose(0, 1).reshape(len(pairs), size)
        self.rows.index_copy_(0, d_idx, rows)

    def load(self, host: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """``block s of every layer of host = row[d]`` for every ``(d, s)``; host slots
        distinct."""
        if not pairs:
            return
        d_idx = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        s_idx = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        rows = self.rows.index_select(0, d_idx)
        for t, (off, size, e) in zip(host, self._layers):
            h = _u8(t)
            blocks = rows[:, off:off + size].reshape(len(pairs), e, *h.shape[2:])
            h.index_copy_(1, s_idx, blocks.transpose(0, 1))

    def read(self, slot: int, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Disk slot ``slot`` as one block per layer, shaped and typed like a block of
        ``like`` (the host pool): ``[E, block_size, heads, dim]`` (tests, debugging)."""
        row = self.rows[slot]
        out = []
        for t, (off, size, e) in zip(like, self._layers):
            shape = (e, *_u8(t).shape[2:])
            out.append(row[off:off + size].clone().reshape(shape).view(t.dtype))
        return out

    def close(self) -> None:
        """Unmap the file and remove the private directory (idempotent)."""
        self.rows = torch.empty(0, dtype=torch.uint8)
        self._mm = None
        self._cleanup()
