"""An ``LLM`` gives its memory, threads and processes back: ``shutdown()``, the context
manager, and dropping the last reference (issue 44).

Engines are built and dropped one after another on the default model (small KV pools);
the process's RSS must come back each time, every engine object must be gone, and no
engine thread or child process may remain.  The ``mp`` executor (TP=2 on CPU, gloo) must
leave no rank process behind.  On a GPU, ``torch.cuda.memory_allocated()`` must return to
its starting value.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import write_dummy_model

KV_BYTES = 16 << 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


def _engine(**kw) -> LLM:
    kw = {"kv_cache_memory_bytes": KV_BYTES, "max_model_len": 128,
          "max_num_batched_tokens": 64, **kw}
    return LLM(**kw)


def _refs(llm: LLM) -> dict[str, weakref.ref]:
    """Weak references to the engine's parts (the model and runner when in process)."""
    engine = llm.llm_engine
    core = engine.client.core
    refs = {"engine": weakref.ref(engine), "core": weakref.ref(core),
            "scheduler": weakref.ref(core.scheduler),
            "executor": weakref.ref(core.executor)}
    worker = getattr(core.executor, "worker", None)
    if worker is not None:
        refs.update(worker=weakref.ref(worker), model=weakref.ref(worker.model),
                    runner=weakref.ref(worker.runner))
    return refs


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, r in refs.items() if r() is not None]


def _rss_mib() -> float:
    """RSS after handing glibc's free heap pages back (else freed memory still counts)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return psutil.Process().memory_info().rss / 2**20


# multiprocessing's own per-interpreter helpers: the fork server the ``mp`` executor
# forks ranks from (it never runs a torch op, so it holds no model or device memory, and
# the next engine's ranks start from it without importing torch again) and the resource
# tracker.  They are the interpreter's, not an engine's.
_MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _live_children() -> list[psutil.Process]:
    """This process's live descendants, but for multiprocessing's helpers."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any(
                    h in " ".join(p.cmdline()) for h in _MP_HELPERS):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_dropped_engines_free_their_memory_threads_and_objects() -> None:
    """Build, use and drop engines in a row: each ``del llm`` (no explicit
    ``gc.collect()``: the finalizer collects the engine's cycles) kills every engine
    object and hands the memory back (RSS drops by most of the engine's weights), RSS
    does not creep up over the cycles, and no thread or child process of the engine is
    left."""
    from pagedllm.models.loader import weight_bytes

    # The first engine imports what the engine imports lazily (transformers, ...) and
    # starts tqdm's monitor thread: neither is the engine's to give back.
    start = _rss_mib()
    llm = _engine()
    llm.generate(["Hello"], PARAMS, use_tqdm=False)
    first = _rss_mib() - start
    weights = weight_bytes(llm.llm_engine.client.core.executor.worker.model) / 2**20
    assert weights > 50, weights
    refs = _refs(llm)
    del llm
    assert not _alive(refs)
    threads = {t.ident for t in threading.enumerate()}
    base = _rss_mib()
    returned, after = [], []
    for _ in range(4):
        llm = _engine()
        llm.generate(["Another prompt"], PARAMS, use_tqdm=False)
        refs = _refs(llm)
        alive = _rss_mib()
        del llm
        assert not _alive(refs)
        after.append(_rss_mib() - base)
        returned.append(alive - base - after[-1])
    # Before the fix a dropped engine stayed, frozen out of the collector, until the
    # next one's start-up: nothing came back on ``del`` (a zeroed CPU KV pool is not
    # resident until written, so the weights are the engine's measure).
    assert min(returned) > weights / 2, (weights, returned)
    assert max(after) < min(weights / 2, first / 4), (weights, first, after)
    assert {t.ident for t in threading.enumerate()} <= threads
    assert not _live_children(), [p.cmdline() for p in _live_children()]


def test_shutdown_is_idempotent_and_later_calls_raise() -> None:
    llm = _engine()
    refs = _refs(llm)
    assert llm.generate(["Hi"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    # The engine's own shutdown (a bare ``LLMEngine``'s way) frees the model at once.
    llm.llm_engine.shutdown()
    assert _alive(refs) == ["engine", "core", "scheduler", "executor", "worker"]
    llm.shutdown()
    assert not _alive(refs)  # freed by shutdown() itself, the LLM still referenced
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hi"], PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.chat([{"role": "user", "content": "Hi"}], PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.get_tokenizer()


def test_grammar_compiler_thread_ends_with_the_engine() -> None:
    """Structured outputs start the core's grammar-compile thread: shutdown stops it."""
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    with _engine() as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=
                                StructuredOutputsParams(choice=["red", "blue"]))
        assert llm.generate(["Colour:"], params, use_tqdm=False)[0].outputs[0].text in (
            "red", "blue")
        compilers = [t for t in threading.enumerate() if t.name.startswith("grammar")]
        assert compilers
    for t in compilers:  # asked to stop; an idle one exits at once
        t.join(timeout=10)
    assert not [t for t in compilers if t.is_alive()]


def test_context_manager_shuts_down_on_exit_and_on_error() -> None:
    with _engine() as llm:
        refs = _refs(llm)
        assert llm.generate(["Hi"], PARAMS, use_tqdm=False)
    assert not _alive(refs)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hi"], PARAMS, use_tqdm=False)
    with pytest.raises(KeyError, match="boom"), _engine() as llm:
        refs = _refs(llm)
        raise KeyError("boom")
    assert not _alive(refs)


def test_mp_executor_tp2_leaves_no_process_behind() -> None:
    """TP=2 with the ``mp`` executor (gloo on CPU): the ranks are gone after leaving the
    ``with`` block, and after dropping the last reference."""
    kw = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
          "quantization": "none", "kv_cache_memory_bytes": 8 << 20,
          "enable_prefix_caching": False}
    with _engine(**kw) as llm:
        pids = [p.pid for p in llm.llm_engine.client.core.executor.procs]
        assert len(pids) == 2
        assert llm.generate(["Hi"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not _live_children(), [p.cmdline() for p in _live_children()]

    llm = _engine(**kw)
    refs = _refs(llm)
    del llm
    assert not _alive(refs)
    assert not _live_children(), [p.cmdline() for p in _live_children()]


@pytest.mark.gpu
def test_gpu_memory_returns_to_its_starting_value(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On CUDA (CUDA graphs captured, Triton kernels warmed): after ``shutdown()`` and
    after dropping the last reference, ``torch.cuda.memory_allocated()`` is exactly what
    it was before the engine, and the kernel warm-up helper is gone."""
    import torch

    torch.cuda.init()
    # What the shutdown frees besides the engine's own -- earlier tests' garbage, cuBLAS
    # workspaces -- is freed first, so the start is comparable.
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    # The SmolLM2 shape with dummy weights: the GPU machine has no model files.
    gpu = {"device": "cuda", "load_format": "dummy", "skip_tokenizer_init": True,
           "model": write_dummy_model("smollm2-135m", str(tmp_path))}
    llm = _engine(**gpu)
    assert llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert torch.cuda.memory_allocated() > start + KV_BYTES
    llm.shutdown()
    assert torch.cuda.memory_allocated() == start
    assert not _live_children(), [p.cmdline() for p in _live_children()]

    for _ in range(2):  # dropped instead of shut down
        llm = _engine(**gpu)
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
        del llm
        assert torch.cuda.memory_allocated() == start
