"""The start-up kernel warm-up (``engine/kernel_warmup.py``): when the helper starts, the
config it builds from config.json's raw keys, and the worker it warms up.  The GPU part
(Triton compiles landing in the cache) is measured on the device: docs/benchmarks.md."""

from __future__ import annotations

import json
import os

import pytest

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, write_dummy_model
from pagedllm.engine import kernel_warmup
from pagedllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("shape", ["llama3-8b", "smollm2-135m"])
def test_raw_config_derives_what_transformers_derives(shape: str, tmp_path) -> None:
    """Everything that picks kernel variants must come out the same from config.json's
    keys as from the transformers config the engine core builds."""
    d = write_dummy_model(shape, str(tmp_path))
    args = EngineArgs(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu")
    real = args.create_engine_config()
    raw = args.create_engine_config(
        hf_config=kernel_warmup.one_layer_config(DUMMY_CONFIGS[shape]))
    for attr in ("num_kv_heads", "head_dim", "vocab_size", "dtype", "max_model_len"):
        assert getattr(raw.model_config, attr) == getattr(real.model_config, attr), attr
    assert raw.model_config.num_layers == 1
    for attr in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "async_scheduling"):
        assert getattr(raw.scheduler_config, attr) == getattr(real.scheduler_config, attr)


def test_warm_up_worker_builds_the_one_layer_model(tmp_path) -> None:
    """The helper's body on the CPU: the real Worker, one decoder layer, a KV cache."""
    d = write_dummy_model("smollm2-135m", str(tmp_path))
    worker = kernel_warmup.warm_up_worker(
        {"model": d, "device": "cpu", "max_model_len": 256, "block_size": 16},
        DUMMY_CONFIGS["smollm2-135m"])
    assert len(worker.model.model.layers) == 1
    assert len(worker.kv_caches) == 1 and worker.runner is not None


def test_start_only_when_it_can_help(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    d = write_dummy_model("smollm2-135m", str(tmp_path))
    args = EngineArgs(model=d, load_format="dummy")
    monkeypatch.setattr(kernel_warmup, "_nvidia_gpu_present", lambda: False)
    assert kernel_warmup.start(args) is None  # no GPU: never
    monkeypatch.setattr(kernel_warmup, "_nvidia_gpu_present", lambda: True)
    assert kernel_warmup.start(EngineArgs(model=d, device="cpu")) is None
    assert kernel_warmup.start(EngineArgs(model=str(tmp_path / "missing"))) is None
    monkeypatch.setenv("PAGEDLLM_KERNEL_WARMUP", "0")
    assert kernel_warmup.start(args) is None
    monkeypatch.delenv("PAGEDLLM_KERNEL_WARMUP")
    # Data-parallel engine 1: its helper would sit on engine 0's device (the default)
    # while engine 0 plans its memory; engine 0's helper warms the cache for both.
    assert kernel_warmup.start(EngineArgs(model=d, load_format="dummy",
                                          data_parallel_size=2,
                                          data_parallel_rank=1)) is None
    # A finished warm-up's marker stops a second one; the key follows the arguments.
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    spec = {k: getattr(args, k) for k in kernel_warmup._ARGS}
    key = kernel_warmup.warmup_key(spec, config)
    assert key != kernel_warmup.warmup_key({**spec, "max_num_seqs": 8}, config)
    os.makedirs(os.path.dirname(kernel_warmup._marker(key)))
    open(kernel_warmup._marker(key), "w").close()
    assert kernel_warmup.start(args) is None
    # Without the marker the helper starts; with no CUDA device visible (hidden here, so
    # that a GPU machine takes the same path) it exits 0 at once.
    os.remove(kernel_warmup._marker(key))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    helper = kernel_warmup.start(args)
    assert helper is not None
    helper.wait(timeout=120)
    assert helper.proc.returncode == 0
    assert not os.path.exists(kernel_warmup._marker(key))  # nothing was compiled
    # Experts across the engines: engine 1 joins engine 0's world, so it waits for a
    # helper of its own as engine 0 does (rather than racing into the rendezvous).
    helper = kernel_warmup.start(EngineArgs(model=d, load_format="dummy",
                                            data_parallel_size=2, data_parallel_rank=1,
                                            enable_expert_parallel=True))
    assert helper is not None
    helper.wait(timeout=120)
    assert helper.proc.returncode == 0
