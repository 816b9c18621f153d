"""The prefix cache's disk pool (worker/disk_pool.py) and its place in the step's block
moves (worker/block_ops.py): bytes round-trip host -> file -> host unchanged (fp32, bf16,
fp8, MLA's one-entry layout, layers of different sizes); within one step a save reads
its host slot before a disk load or an offload rewrites it, and a block offloaded,
pushed on to disk and loaded back over later steps equals the original bitwise (on a
GPU, with an offload still in flight); the private directory goes away on close."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.worker.block_ops import BlockOps, allocate_swap_space
from pagedllm.worker.disk_pool import DiskPool
from tests.kernels.test_block_ops import caches, sched


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype, entries", [
    (torch.float32, 2), (torch.bfloat16, 2), (torch.float8_e4m3fn, 2), (torch.bfloat16, 1)])
def test_save_load_round_trip(tmp_path, dtype, entries) -> None:
    g = torch.Generator().manual_seed(1)
    host = [torch.randn((entries, 6, 4, heads, 8), generator=g).to(dtype)
            for heads in (2, 1, 3)]  # layers of different sizes
    pool = DiskPool(5, host, str(tmp_path))
    assert os.path.dirname(pool.dir) == str(tmp_path)
    assert pool.block_bytes == sum(t[:, 0].numel() * t.element_size() for t in host)
    want = [t[:, [1, 4]].clone() for t in host]
    pool.save(host, [(1, 3), (4, 0)])
    assert all(torch.equal(_raw(a), _raw(torch.stack(b, 1)))
               for a, b in zip(want, zip(pool.read(3, host), pool.read(0, host))))
    for t in host:
        t.zero_()
    pool.load(host, [(0, 2), (3, 5)])  # into other slots
    for t, w in zip(host, want):
        assert torch.equal(_raw(t[:, 5]), _raw(w[:, 0]))
        assert torch.equal(_raw(t[:, 2]), _raw(w[:, 1]))
    d = pool.dir
    pool.close()
    pool.close()
    assert not os.path.exists(d)


def test_finalizer_removes_the_directory_without_close(tmp_path) -> None:
    host = [torch.zeros((2, 2, 4, 1, 8))]
    pool = DiskPool(2, host, str(tmp_path))
    d = pool.dir
    del pool
    import gc

    gc.collect()
    assert not os.path.exists(d)


def test_disk_moves_go_first_in_the_step(tmp_path) -> None:
    """One step: host slot 0's key goes to disk while slot 0 takes a disk hit and slot 1
    a new offload; the loads read the slots after the disk moves."""
    kv = caches("cpu", 8, torch.bfloat16)
    host = allocate_swap_space(2, kv[0], len(kv))
    disk = DiskPool(4, host, str(tmp_path))
    ops = BlockOps(kv, offload_caches=host, disk_pool=disk)
    old = [t[:, 3].clone() for t in kv]
    ops.apply(sched(kv_offload=[(3, 0)]))  # block 3 -> host slot 0
    ops.apply(sched(kv_offload=[(4, 1)]))
    blk4 = [t[:, 4].clone() for t in kv]
    # Slot 0 (block 3's bytes) is saved to disk slot 2; slot 1 (block 4's) to disk 1,
    # refilled with block 5's; block 3's bytes come back: disk 2 -> slot 0 -> block 7.
    ops.apply(sched(kv_disk_save=[(0, 2), (1, 1)], kv_disk_load=[(2, 0)],
                    kv_offload=[(5, 1)], kv_load=[(0, 7)]))
    for t, o in zip(kv, old):
        assert torch.equal(t[:, 7], o)
    for h, t in zip(host, kv):
        assert torch.equal(h[:, 1], t[:, 5])
    assert all(torch.equal(a, b) for a, b in zip(disk.read(1, host), blk4))
    with pytest.raises(RuntimeError, match="no disk pool"):
        BlockOps(kv, offload_caches=host).apply(sched(kv_disk_save=[(0, 0)]))
    disk.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_to_host_to_disk_and_back_bitwise(tmp_path) -> None:
    """On CUDA an offload lands in the host pool later, without waiting; a save of its
    slot in the next step waits for it, so the disk gets the offloaded bytes."""
    kv = caches("cuda", 40, torch.bfloat16, layers=4, block=(16, 8, 128))
    host = allocate_swap_space(4, kv[0], len(kv))
    disk = DiskPool(8, host, str(tmp_path))
    ops = BlockOps(kv, offload_caches=host, disk_pool=disk)
    want = [t[:, 8:12].clone() for t in kv]
    ops.apply(sched(kv_offload=[(8 + i, i) for i in range(4)]))
    for t in kv:  # the new owners overwrite the device blocks
        t[:, 8:12] = 0
    ops.apply(sched(kv_disk_save=[(i, 4 + i) for i in range(4)]))
    ops.apply(sched(kv_disk_load=[(4 + i, 3 - i) for i in range(4)],
                    kv_load=[(3 - i, 20 + i) for i in range(4)]))
    ops.apply(sched())
    torch.cuda.synchronize()
    for t, w in zip(kv, want):
        assert torch.equal(t[:, 20:24], w)
    disk.close()


def test_file_is_reserved_and_unlinked_and_too_large_is_a_value_error(tmp_path) -> None:
    """The file is reserved at full size and unlinked once mapped (a killed engine leaves
    no blocks behind); a reservation the filesystem cannot hold is a ValueError naming
    kv_offload_disk_bytes, and leaves no directory behind."""
    host = [torch.zeros((2, 3, 4, 2, 8))]
    pool = DiskPool(4, host, str(tmp_path))
    assert os.listdir(pool.dir) == []  # mapped, not on disk
    pool.save(host, [(0, 3)])
    pool.load(host, [(3, 1)])
    pool.close()
    with pytest.raises(ValueError, match="kv_offload_disk_bytes: cannot reserve"):
        DiskPool(1 << 45, host, str(tmp_path))  # 2**45 blocks of 1 KiB: 32 PiB
    assert os.listdir(tmp_path) == []
