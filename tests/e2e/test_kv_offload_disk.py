"""The prefix cache's disk tier (``kv_offload_disk_bytes``) on the real default model
(CPU, fp32), with a device pool and a host pool both too small for three
conversations: greedy outputs equal prefix caching off token for token, a turn whose
history starts on disk (where the device and host alone miss) hits, a block that went
device -> host -> disk -> device keeps its bytes, the private directory is removed at
shutdown, and bad values are ValueErrors naming the argument."""

from __future__ import annotations

import argparse
import os
import shutil
from collections import Counter

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.request import Request
from tests.e2e.test_kv_offload import (  # noqa: F401
    BLOCK_BYTES,
    _block,
    _core,
    history,
    reference,
    tiny,
    turns,
)

HOST_BLOCKS = 2  # (the device pool holds 8)


def test_disk_tier_equals_caching_off_hits_and_round_trips_bitwise(reference,  # noqa: F811
                                                                    tmp_path) -> None:
    llm = tiny(kv_offload_bytes=HOST_BLOCKS * BLOCK_BYTES,
               kv_offload_disk_bytes=32 * BLOCK_BYTES, kv_offload_disk_path=str(tmp_path))
    core = _core(llm)
    sched, worker = core.scheduler, core.executor.worker
    tier = sched.offload
    assert tier is not None and tier.disk is not None and tier.disk.num_disk_blocks == 32
    disk, disk_pool, pool = tier.disk, worker.disk_pool, sched.kv.pool
    assert disk_pool is not None and os.path.dirname(disk_pool.dir) == str(tmp_path)
    totals: Counter[str] = Counter()
    make_stats = sched.make_stats

    def counting_stats():
        st = make_stats()
        totals.update(dq=st.kv_offload_disk_queries, dh=st.kv_offload_disk_hits,
                      to_disk=st.kv_offload_bytes_to_disk,
                      from_disk=st.kv_offload_bytes_from_disk)
        return st

    sched.make_stats = counting_stats
    probe = Request("probe", history(2), SamplingParams(temperature=0.0), None, 0.0)
    keys2 = sched.kv.block_keys(probe, 3)  # conversation 2's first-turn blocks
    sched.kv.req_to_hashes.pop("probe")
    saved: dict[object, torch.Tensor] = {}

    def on_turn(t: int, c: int) -> None:
        if (t, c) == (0, 2):  # conversation 2's blocks, as computed
            for key in keys2:
                saved[key] = _block(worker.kv_caches, pool.get_cached_block(key).block_id
                                    ).clone()
        if (t, c) == (1, 1):
            # Pushed on from the host by conversations 0 and 1: every block on disk
            # only, so the device and the host alone would miss the whole history;
            # the file holds the bytes computed.
            for k in keys2:
                assert pool.get_cached_block(k) is None and k not in tier and k in disk
                blocks = disk_pool.read(disk.slot_of(k), worker.offload_caches)
                assert torch.equal(torch.stack(blocks), saved[k])
        if (t, c) == (1, 2):  # loaded back (disk -> host -> device): the same bytes
            for k in keys2:
                b = pool.get_cached_block(k)
                assert b is not None
                assert torch.equal(_block(worker.kv_caches, b.block_id), saved[k])

    outs, cached = turns(llm, on_turn)
    sched.make_stats()
    assert outs == reference
    assert cached[5] >= 48  # all three of conversation 2's first-turn blocks
    assert totals["dh"] >= 48 and totals["dq"] >= totals["dh"]
    assert totals["from_disk"] == totals["dh"] // 16 * BLOCK_BYTES
    assert totals["to_disk"] > 0
    tier.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks
    directory = disk_pool.dir
    llm.llm_engine.shutdown()
    assert not os.path.exists(directory) and not os.listdir(tmp_path)


def _config(default_model_path: str, **kw):
    return EngineArgs(model=default_model_path, **kw).create_engine_config()


def test_engine_config_sizes_the_disk_pool(default_model_path, tmp_path) -> None:
    cc = _config(default_model_path, kv_offload_bytes=1 << 24,
                 kv_offload_disk_bytes=1 << 26, kv_offload_disk_path=str(tmp_path)
                 ).cache_config
    assert cc.num_offload_disk_blocks == (1 << 26) // cc.kv_offload_block_bytes > 0
    assert cc.kv_offload_disk_path == str(tmp_path)
    assert _config(default_model_path).cache_config.num_offload_disk_blocks == 0


@pytest.mark.parametrize("kw, match", [
    ({"kv_offload_disk_bytes": -1}, "kv_offload_disk_bytes must be"),
    ({"kv_offload_disk_bytes": 1 << 26, "kv_offload_bytes": 0},
     "kv_offload_disk_bytes: .*needs kv_offload_bytes"),
    ({"kv_offload_disk_bytes": 4 * shutil.disk_usage("/").total},
     "kv_offload_disk_bytes .* exceeds the free space"),
    ({"kv_offload_disk_bytes": 1}, "kv_offload_disk_bytes .* holds no KV block"),
])
def test_bad_sizes_are_value_errors_naming_the_argument(default_model_path, tmp_path,
                                                         kw, match) -> None:
    kw = {"kv_offload_bytes": 1 << 24, "kv_offload_disk_path": str(tmp_path), **kw}
    with pytest.raises(ValueError, match=match):
        _config(default_model_path, **kw)


def test_bad_paths_are_value_errors_naming_the_path(default_model_path, tmp_path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    for path in (tmp_path / "missing", a_file):
        with pytest.raises(ValueError, match="kv_offload_disk_path .* not a writable"):
            _config(default_model_path, kv_offload_bytes=1 << 24,
                    kv_offload_disk_bytes=1 << 26, kv_offload_disk_path=str(path))
    if os.geteuid() != 0:  # (root writes anywhere)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="kv_offload_disk_path"):
            _config(default_model_path, kv_offload_bytes=1 << 24,
                    kv_offload_disk_bytes=1 << 26, kv_offload_disk_path=str(ro))


def test_cli_flags_set_bytes_and_path(tmp_path) -> None:
    from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "m", "--kv-offload-size", "1",
                         "--kv-offload-disk-size", "0.5", "--kv-offload-disk-path",
                         str(tmp_path)])
    ea = engine_args_from_cli(args)
    assert (ea.kv_offload_disk_bytes, ea.kv_offload_disk_path) == (1 << 29, str(tmp_path))
    ea = engine_args_from_cli(p.parse_args(["--model", "m"]))
    assert (ea.kv_offload_disk_bytes, ea.kv_offload_disk_path) == (0, None)
    text = p.format_help()
    assert "--kv-offload-disk-size" in text and "--kv-offload-disk-path" in text
