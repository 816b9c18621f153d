"""Block moves (worker/block_ops.py): the step's order -- offloads before loads, so a
block saved and looked up in one step round-trips -- on the CPU (synchronous, fp8 as
bytes), and on CUDA the host tier's loads on a copy stream: issued without a host sync,
landed before the next step's work reads them (its compute stream waits for them)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.worker.block_ops import BlockOps, allocate_swap_space


def sched(**moves: list[tuple[int, int]]) -> SchedulerOutput:
    return SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={},
                           total_num_scheduled_tokens=0, finished_req_ids=set(),
                           preempted_req_ids=set(), forks=[], **moves)


def caches(device: str, num_blocks: int, dtype: torch.dtype = torch.float32,
           layers: int = 3, block: tuple[int, ...] = (4, 2, 8)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn((2, num_blocks, *block), generator=g).to(dtype).to(device)
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_offload_then_load_round_trips_in_one_step_on_cpu(dtype) -> None:
    kv = caches("cpu", 8, dtype)
    host = allocate_swap_space(4, kv[0], len(kv))
    ops = BlockOps(kv, offload_caches=host)
    before = [t[:, 5].clone() for t in kv]
    # Block 5 is evicted to slot 2 and looked up again into block 1, in one step.
    ops.apply(sched(kv_offload=[(5, 2)], kv_load=[(2, 1)], block_copies=[(1, 6)]))
    for t, b in zip(kv, before):
        assert torch.equal(t[:, 1].view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(t[:, 6].view(torch.uint8), b.view(torch.uint8))  # copies last
    assert ops._loads_done is None  # the CPU has no streams: nothing to wait for


def test_step_loads_name_every_loaded_tensor_once() -> None:
    """The step's ``LayerLoads`` lists each KV tensor (landed already on the CPU):
    ``finish`` counts those no attention layer waited for; the next step clears it."""
    kv = caches("cpu", 8)
    ops = BlockOps(kv, offload_caches=allocate_swap_space(4, kv[0], len(kv)))
    ops.apply(sched(kv_offload=[(5, 2)]))
    assert ops.step_loads is None  # no loads, nothing to wait for
    ops.apply(sched(kv_load=[(2, 1)]))
    loads = ops.step_loads
    assert loads is not None
    loads.wait(kv[0])
    loads.wait(kv[0])  # a second layer on one tensor (hybrid groups): nothing more
    loads.wait(kv[2][0])  # a view from the tensor's start is the same tensor
    assert loads.finish() == 1  # kv[1]'s
    ops.check_waits(loads)
    assert (ops.load_steps, ops.missed_waits) == (1, 0)
    ops.apply(sched(kv_load=[(2, 3)]))
    assert ops.step_loads is not None and ops.step_loads is not loads
    ops.check_waits(ops.step_loads)
    assert (ops.load_steps, ops.missed_waits) == (2, 1)
    ops.apply(sched())
    assert ops.step_loads is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loads_overlap_and_land_before_the_next_step_reads_them() -> None:
    # Big blocks (8 MiB each, 64 per step), so that the copy is still running when the
    # host returns from ``apply``.
    kv = caches("cuda", 80, torch.bfloat16, layers=4, block=(16, 8, 128 * 128))
    host = allocate_swap_space(72, kv[0], len(kv))
    assert host[0].is_pinned()
    for h in host:
        h.copy_(torch.randn(h.shape).to(h.dtype))
    ops = BlockOps(kv, offload_caches=host)
    assert ops._load_stream is not None
    loads = [(s, 8 + s) for s in range(64)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # no host sync on the load path
    try:
        ops.apply(sched(kv_load=loads))
        assert ops._loads_done is not None
        ops.apply(sched())  # the next step: its compute stream waits for the loads
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = [t[:, 8:72].clone() for t in kv]  # queued on the compute stream, after the wait
    torch.cuda.synchronize()
    for g, h in zip(got, host):
        assert torch.equal(g.cpu(), h[:, :64])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_layer_reads_its_loads_in_the_same_step_after_its_wait() -> None:
    """The step that issues loads reads them: each layer's ``wait`` orders the compute
    stream after that tensor's copies only (no host sync); what it reads then is the
    host's bytes, the first layer's while later layers may still be copying."""
    kv = caches("cuda", 80, torch.bfloat16, layers=4, block=(16, 8, 128 * 128))
    host = allocate_swap_space(72, kv[0], len(kv))
    for h in host:
        h.copy_(torch.randn(h.shape).to(h.dtype))
    ops = BlockOps(kv, offload_caches=host)
    zero = [t[:, 0].cpu() for t in kv]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # With offloads in the same step (blocks 0..7 to slots 64..71), one of which
        # comes straight back (slot 64 -> block 79): layer i's scatter precedes its loads.
        ops.apply(sched(kv_offload=[(b, 64 + b) for b in range(8)],
                        kv_load=[*((s, 8 + s) for s in range(64)), (64, 79)]))
        loads = ops.step_loads
        assert loads is not None
        got = []
        for t in kv:  # the forward: a layer waits, then reads its tensor
            loads.wait(t)
            got.append((t[:, 8:72] * 1, t[:, 79] * 1))
        ops.check_waits(loads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert ops.missed_waits == 0
    for (g, back), h, z in zip(got, host, zero):
        assert torch.equal(g.cpu(), h[:, :64]) and torch.equal(back.cpu(), z)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloads_read_before_the_loads_overwrite_and_swaps_still_work() -> None:
    kv = caches("cuda", 16)
    host = allocate_swap_space(4, kv[0], len(kv))
    swap = allocate_swap_space(4, kv[0], len(kv))
    ops = BlockOps(kv, swap, host)
    old = [t[:, 3].cpu() for t in kv]
    # Block 3's old KV goes to slot 0 and slot 0 comes back into block 3 and into 9,
    # while block 4 is swapped out and back into block 12.
    four = [t[:, 4].cpu() for t in kv]
    ops.apply(sched(kv_offload=[(3, 0)], kv_load=[(0, 9)], swap_out=[(4, 1)]))
    ops.apply(sched(swap_in=[(1, 12)]))
    torch.cuda.synchronize()
    for t, o, f in zip(kv, old, four):
        assert torch.equal(t[:, 9].cpu(), o) and torch.equal(t[:, 12].cpu(), f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloads_copy_without_a_host_sync_and_land_in_order() -> None:
    kv = caches("cuda", 80, torch.bfloat16, layers=4, block=(16, 8, 128 * 128))
    host = allocate_swap_space(72, kv[0], len(kv))
    ops = BlockOps(kv, offload_caches=host)
    first = [t[:, 8:40].cpu() for t in kv]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # no host sync on the offload path
    try:
        ops.apply(sched(kv_offload=[(8 + i, i) for i in range(32)]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The forward's new owners overwrite the offloaded blocks; the host keeps the old KV.
    for t in kv:
        t[:, 8:40].fill_(7.0)
    # Slot 0 is reused for block 50 before the first offload may have landed: the newer
    # bytes win.  Then slot 0 and slot 5 are loaded back in one step (waits for both).
    fifty = [t[:, 50].cpu() for t in kv]
    ops.apply(sched(kv_offload=[(50, 0)]))
    ops.apply(sched(kv_load=[(0, 60), (5, 61)]))
    ops.apply(sched())
    torch.cuda.synchronize()
    for t, h, f, old in zip(kv, host, fifty, first):
        assert torch.equal(h[:, 1:32], old[:, 1:32]) and torch.equal(h[:, 0], f)
        assert torch.equal(t[:, 60].cpu(), f) and torch.equal(t[:, 61].cpu(), old[:, 5])


def test_offloads_land_within_the_step_on_cpu() -> None:
    kv = caches("cpu", 8)
    host = allocate_swap_space(4, kv[0], len(kv))
    ops = BlockOps(kv, offload_caches=host)
    old = [t[:, 3].clone() for t in kv]
    ops.apply(sched(kv_offload=[(3, 1)]))
    for h, o in zip(host, old):
        assert torch.equal(h[:, 1], o)


def test_round_trip_with_strided_device_blocks_on_cpu() -> None:
    """A layer's KV may be a strided view (no 8-byte word view of it): the pool's copies
    then view both sides alike, element for element."""
    wide = caches("cpu", 8, block=(4, 2, 16))
    kv = [t[..., :8] for t in wide]  # rows of 8 floats inside rows of 16
    assert not kv[0].is_contiguous()
    host = allocate_swap_space(4, kv[0], len(kv))
    ops = BlockOps(kv, offload_caches=host)
    old = [t[:, 3].clone() for t in kv]
    ops.apply(sched(kv_offload=[(3, 2)]))
    ops.apply(sched(kv_load=[(2, 6)]))
    for t, o in zip(kv, old):
        assert torch.equal(t[:, 6], o)
