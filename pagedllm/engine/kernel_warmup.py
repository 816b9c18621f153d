"""Start-up kernel warm-up: compile the engine's Triton kernels in a helper process while
the engine core is still importing transformers and building its config.

Why: on a machine whose Triton cache is empty, the memory profile and the CUDA-graph
capture compile every kernel variant the engine uses, one after another (14 variants,
~5.4 s of compiler time for the Llama-3-8B shape on an H200), and building the config
(importing transformers) takes the engine core another 9-11 s before that.  The two are
independent: the helper needs only the layer shapes, which config.json states.

What the helper does: it builds the engine's real ``Worker`` for the same engine
arguments, with one decoder layer and dummy weights, runs the memory profile and
captures the CUDA graphs -- the very code paths the engine core runs next, so every
kernel launch has the same shapes, dtypes and specialisations and lands in Triton's
on-disk cache.  The engine core then loads them from there.  It uses config.json's keys
directly (no transformers import); where they differ from what transformers would
derive, a variant is merely compiled later by the core, never computed wrongly.

The core waits for the helper to exit before its own memory plan (the helper's CUDA
context must be gone before free memory is measured).  A marker file keyed by the model
shape, the engine arguments that pick kernel variants, the kernel sources and the
Triton/torch versions records a finished warm-up, so a later start with a warm cache
does not start the helper again.  ``PAGEDLLM_KERNEL_WARMUP=0`` turns it off.

Run as ``python -m pagedllm.engine.kernel_warmup '<engine args as JSON>'``.  This module
imports neither torch nor transformers at module level: the core imports it first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

import pagedllm.envs as envs

logger = logging.getLogger("pagedllm")

# Engine arguments the helper takes over (those that decide shapes and code paths).
_ARGS = ("model", "dtype", "max_model_len", "block_size", "max_num_seqs",
         "max_num_batched_tokens", "enforce_eager", "max_cudagraph_capture_size", "device",
         "quantization", "kv_cache_dtype")
# Defaults for keys a config.json may omit (LlamaConfig's).
_CONFIG_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                    "rope_theta": 10000.0, "tie_word_embeddings": False,
                    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _enabled() -> bool:
    return envs.kernel_warmup()


def _nvidia_gpu_present() -> bool:
    """Whether an NVIDIA driver is loaded and a device is visible -- without importing
    torch (on a CPU-only machine the helper would only cost an import of torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".triton", "cache")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def warmup_key(args: dict[str, Any], config: dict[str, Any]) -> str:
    """Identifies one warm-up: the model's shape keys, the engine arguments in ``_ARGS``
    but the model path, the kernel sources (size and mtime of every module under
    ``pagedllm/``) and the triton and torch versions."""
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in args.items() if k != "model"}, sort_keys=True,
                        default=str).encode())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for root, _, files in sorted(os.walk(_PKG_DIR)):
        for f in sorted(files):
            if f.endswith(".py"):
                st = os.stat(os.path.join(root, f))
                h.update(f"{root}/{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"triton={_version('triton')} torch={_version('torch')}".encode())
    return h.hexdigest()[:32]


def _marker(key: str) -> str:
    return os.path.join(_cache_dir(), "pagedllm-warmup", key)


@dataclass
class WarmupProcess:
    """A running helper; ``wait`` before the engine core plans its GPU memory."""

    proc: subprocess.Popen[bytes]
    started: float

    def wait(self, timeout: float = 120.0) -> None:
        """Block until the helper exits (killed after ``timeout`` seconds); logs what
        the wait cost.  Never raises: a failed warm-up only means later compiles."""
        t0 = time.perf_counter()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            logger.warning("kernel warm-up still running after %.0f s; stopped it", timeout)
        logger.info("kernel warm-up helper exited (%s) %.1f s after start; waited %.1f s",
                    "ok" if rc == 0 else f"status {rc}", time.perf_counter() - self.started,
                    time.perf_counter() - t0)


def start(engine_args: Any) -> WarmupProcess | None:
    """Start the helper for ``engine_args`` (an ``EngineArgs``) if it can help: a GPU
    start (device not "cpu") of a model directory with a config.json, warm-up not
    turned off, no marker of an identical finished warm-up, and not a data-parallel
    engine ``d > 0`` of independent engines.  Returns None otherwise.  Cheap: reads
    config.json and stats the package's sources.

    Why: the helper runs on the default device, which is engine 0's; engine ``d > 0``
    plans its memory on its own device (``worker.device_index``), and its helper would
    sit on engine 0's while engine 0 plans, shrinking that plan.  The kernels are the
    same for every engine, so engine 0's helper warms the shared Triton cache for all.
    With experts across the engines each still starts one: their ranks share one world,
    so engine ``d`` must wait for a helper as long as engine 0 does before joining it
    (and engine 0 plans only after every engine's ranks have loaded, helpers gone)."""
    if not _enabled() or getattr(engine_args, "device", "auto") == "cpu" \
            or not _nvidia_gpu_present():
        return None
    if getattr(engine_args, "data_parallel_rank", 0) and not (
            getattr(engine_args, "enable_expert_parallel", False)
            and getattr(engine_args, "data_parallel_size", 1) > 1):
        return None
    model = getattr(engine_args, "model", None)
    cfg_path = os.path.join(model, "config.json") if model else ""
    if not model or not os.path.isdir(model) or not os.path.isfile(cfg_path):
        return None
    if getattr(engine_args, "load_format", "auto") == "gguf":
        return None
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    # Pooling models run eagerly, without the paged-attention kernels or graphs: an
    # encoder / cross-encoder (no *ForCausalLM) or a decoder under runner "pooling".
    archs = config.get("architectures") or []
    if getattr(engine_args, "runner", "auto") == "pooling" or (
            archs and not any(str(a).endswith("ForCausalLM") for a in archs)):
        return None
    names = {f.name for f in fields(engine_args)}
    args = {k: getattr(engine_args, k) for k in _ARGS if k in names}
    key = warmup_key(args, config)
    if os.path.exists(_marker(key)):
        return None
    # The helper imports this very pagedllm, whatever its working directory holds.
    root = os.path.dirname(_PKG_DIR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.engine.kernel_warmup",
                             json.dumps({"args": args, "key": key})], env=env)
    return WarmupProcess(proc, time.perf_counter())


def one_layer_config(config: dict[str, Any]) -> SimpleNamespace:
    """config.json's keys as attributes, with one decoder layer (and LlamaConfig's
    defaults for the keys the model reads without a fallback)."""
    ns = SimpleNamespace(**{**_CONFIG_DEFAULTS, **config})
    ns.num_hidden_layers = 1
    return ns


def warm_up_worker(args: dict[str, Any], config: dict[str, Any]) -> Any:
    """Build the one-layer ``Worker`` for engine arguments ``args`` and config.json's
    keys ``config`` (dummy weights), run its memory plan and allocate a small KV cache
    -- which on a GPU profiles the largest step and captures the CUDA graphs.  Returns
    the worker (tests inspect it)."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker.worker import Worker

    eargs = EngineArgs(**{**args, "load_format": "dummy", "skip_tokenizer_init": True})
    engine_config = eargs.create_engine_config(hf_config=one_layer_config(config))
    worker = Worker(engine_config)
    worker.load_model()  # on a GPU this also installs the compile counter
    worker.determine_num_blocks()  # on a GPU: the memory profile, the largest step
    need = -(-engine_config.model_config.max_model_len //
             engine_config.cache_config.block_size) + 2
    worker.initialize_cache(need)  # a small cache, then the CUDA graphs (unless eager)
    return worker


def run(args: dict[str, Any], key: str) -> int:
    """The helper's body: warm up on the GPU, then write the marker.  Exit status 0 also
    when there is nothing to do (no CUDA device)."""
    import torch

    if not torch.cuda.is_available():
        print("pagedllm kernel warm-up: no CUDA device, nothing to compile", file=sys.stderr)
        return 0
    from pagedllm.kernels import compile_stats

    t0 = time.perf_counter()
    with open(os.path.join(args["model"], "config.json")) as f:
        config = json.load(f)
    warm_up_worker({**args, "device": "cuda"}, config)
    torch.cuda.synchronize()
    st = compile_stats.snapshot()
    os.makedirs(os.path.dirname(_marker(key)), exist_ok=True)
    with open(_marker(key), "w") as f:
        json.dump({"args": args, "compiled": st.compiled, "cache_hits": st.cache_hits}, f)
    print(f"pagedllm kernel warm-up: {st.compiled} Triton kernel variants compiled "
          f"({st.compile_s:.1f} s of compiler time), {st.cache_hits} from the cache, in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pagedllm.engine.kernel_warmup '<json>'", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING)  # the worker's INFO lines are the core's
    try:
        return run(spec["args"], spec["key"])
    except Exception as e:  # the core reports real problems itself, in its own words
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"pagedllm kernel warm-up stopped: {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
