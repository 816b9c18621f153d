"""Every environment variable pagedllm reads, in one place (as vLLM's ``vllm/envs.py``).

Each variable is read through its function here, at call time (so a test's
``monkeypatch.setenv`` takes effect without a reload).  Everything else is configured
through engine arguments (``config.py``, the CLI); a variable is here only where an
argument does not fit: a secret, a path on the host, a process-wide logging or
diagnostic switch, or a table the sweeps in ``benchmarks/`` write for another GPU model.

Variable (type, default): why it exists.

* ``PAGEDLLM_LOGGING_LEVEL`` (str, ``INFO``): the log level of every pagedllm process
  (API server, engine core, workers), as vLLM's ``VLLM_LOGGING_LEVEL``.
* ``PAGEDLLM_API_KEY`` (str, unset): the server's bearer key when ``--api-key`` is not
  given: a secret does not belong on a command line.
* ``PAGEDLLM_CACHE_DIR`` (path, ``~/.cache/pagedllm``): on-disk caches (tokenizers
  converted from GGUF files).
* ``PAGEDLLM_KERNEL_CACHE`` (path, ``~/.cache/pagedllm/kernels``): the CPU's C kernels,
  compiled once per source, flags and CPU.
* ``PAGEDLLM_KERNEL_WARMUP`` (bool, on; ``0`` off): compile the Triton kernels in a
  helper process while the model loads.
* ``PAGEDLLM_STEP_TRACE`` (path, unset): one JSON line per engine step (a diagnostic
  that the W2 suite, ``bench structured`` and ``bench throughput --step-log`` read).
* ``PAGEDLLM_TEMPLATE_MEMORY_BYTES`` (int, ``1 << 30``): the memory limit of the process
  that renders request-supplied chat templates.
* ``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` (bool, off; vLLM's name works too): the
  server's adapter load/unload routes, which read any path the server can.
* ``PAGEDLLM_FP8_GEMM_CONFIGS``, ``PAGEDLLM_WNA16_CONFIGS``,
  ``PAGEDLLM_WNA16_TC_CONFIGS``, ``PAGEDLLM_WNA16_KMAJOR_CONFIGS`` (path, unset: the
  table shipped for this GPU, if any):
  a launch table a sweep in ``benchmarks/`` wrote for a GPU model we ship none for.

Standard variables of other tools (``HF_HOME``, ``CUDA_VISIBLE_DEVICES``,
``TRITON_INTERPRET``, ...) are read where they are used.  Test-only hooks live in the
tests (``tests/server/engine_hooks``), not here.
"""

from __future__ import annotations

import os

_HOME_CACHE = os.path.join("~", ".cache", "pagedllm")


def logging_level() -> str:
    """``PAGEDLLM_LOGGING_LEVEL``: the level of the ``pagedllm`` logger and of the engine
    core's and workers' processes (vLLM's ``VLLM_LOGGING_LEVEL``), upper-cased."""
    return os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """``PAGEDLLM_API_KEY``: the server's bearer key when ``--api-key`` is not given (a
    secret belongs in the environment, not on a command line other users can read)."""
    return os.environ.get("PAGEDLLM_API_KEY") or None


def cache_dir() -> str:
    """``PAGEDLLM_CACHE_DIR``: root of pagedllm's on-disk caches (converted tokenizers)."""
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser(_HOME_CACHE)


def kernel_cache_dir() -> str:
    """``PAGEDLLM_KERNEL_CACHE``: where ``cpu/build.py`` keeps the C kernels it compiles
    (keyed by source, flags and CPU), so that only the first start pays the compiler."""
    return os.environ.get("PAGEDLLM_KERNEL_CACHE") or os.path.expanduser(
        os.path.join(_HOME_CACHE, "kernels"))


def kernel_warmup() -> bool:
    """``PAGEDLLM_KERNEL_WARMUP`` (on; ``0`` off): the engine core's start-up helper that
    compiles the Triton kernels while the model loads (``engine/kernel_warmup.py``)."""
    return os.environ.get("PAGEDLLM_KERNEL_WARMUP", "1") != "0"


def step_trace_path() -> str | None:
    """``PAGEDLLM_STEP_TRACE``: a JSONL file that ``EngineCore.step()`` appends one line
    per step to (``engine/step_trace.py``; read by ``benchmarks/profile_step.py``,
    ``pagedllm bench structured`` and ``bench throughput --step-log``)."""
    return os.environ.get("PAGEDLLM_STEP_TRACE") or None


def template_memory_bytes() -> int:
    """``PAGEDLLM_TEMPLATE_MEMORY_BYTES``: the address-space limit of the process that
    renders request-supplied chat templates (``entrypoints/openai/template_worker.py``): a
    runaway template gets ``MemoryError`` instead of swapping the host."""
    value = os.environ.get("PAGEDLLM_TEMPLATE_MEMORY_BYTES", "")
    try:
        return int(value) if value else 1 << 30
    except ValueError:
        raise ValueError("PAGEDLLM_TEMPLATE_MEMORY_BYTES: expected an integer, got "
                         f"{value!r}") from None


def allow_runtime_lora_updating() -> bool:
    """``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` or vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (off): enables the server's
    ``/v1/load_lora_adapter`` routes, which read any path the server can."""
    return any(os.environ.get(k, "").lower() in ("1", "true")
               for k in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                         "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"))




# Tuned launch tables.  ``kernels/tuned/<prefix>_<GPU name>.json`` ships the tables swept
# on the GPUs we measured; on another GPU model a sweep in ``benchmarks/`` writes one
# (``--table``) and these variables point the engine at it (vLLM's
# ``VLLM_TUNED_CONFIG_FOLDER`` plays this part for its fused-MoE tables).
TUNED_TABLE_ENV = {
    "fp8_gemm": "PAGEDLLM_FP8_GEMM_CONFIGS",  # kernels/fp8_gemm.py
    "wna16": "PAGEDLLM_WNA16_CONFIGS",  # kernels/wna16_stripe.py, benchmarks/wna16_sweep.py
    "wna16_tc": "PAGEDLLM_WNA16_TC_CONFIGS",  # kernels/wna16_tc_config.py, wna16_tc_sweep.py
    # kernels/wna16_kmajor.py (the GEMV), benchmarks/wna16_kmajor_sweep.py
    "wna16_kmajor": "PAGEDLLM_WNA16_KMAJOR_CONFIGS",
}


def tuned_table_path(prefix: str) -> str | None:
    """The tuned table named for ``prefix`` (a key of ``TUNED_TABLE_ENV``), if set."""
    return os.environ.get(TUNED_TABLE_ENV[prefix]) or None
