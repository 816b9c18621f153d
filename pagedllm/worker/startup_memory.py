"""Out of memory at start-up: one line saying what to change, not a traceback.

``out_of_memory_hint(phase, config)`` wraps a start-up phase of ``EngineCore``; an
out-of-memory error inside it (``torch.OutOfMemoryError`` on a GPU, the CPU allocator's
``RuntimeError``, ``MemoryError``) becomes ``StartupMemoryError``, a ``ValueError`` whose
message names the flags to change -- so the server prints it as its one-line reason and
exits 1, and ``LLM(...)`` raises it.  ``check_cpu_kv_fits`` refuses a CPU KV cache larger
than the memory available *before* allocating it (an oversized ``torch.zeros`` would be
touched page by page until the kernel's OOM killer ends the process, with no message).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pagedllm.config import EngineConfig

KV_FLAGS = ("--kv-cache-memory-bytes", "--max-model-len", "--gpu-memory-utilization",
            "--max-num-seqs")
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


class StartupMemoryError(ValueError):
    """Start-up ran out of memory; the message is one line naming what to change."""


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    if not isinstance(e, RuntimeError):  # torch.OutOfMemoryError is a RuntimeError
        return False
    if type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e).lower()
    return any(t in text for t in _OOM_TEXT)


def _what_to_change(phase: str, config: EngineConfig) -> str:
    mc, sc, cc = config.model_config, config.scheduler_config, config.cache_config
    if phase == "model":
        return (f"the model's weights do not fit in {config.device_config.device} memory: "
                "free memory (other processes), use a smaller or quantised model, or "
                "another device")
    kv = (f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes}"
          if cc.kv_cache_memory_bytes is not None
          else f"--gpu-memory-utilization {cc.gpu_memory_utilization}")
    return (f"lower {kv}, --max-model-len ({mc.max_model_len}) or --max-num-seqs "
            f"({sc.max_num_seqs})")


@contextlib.contextmanager
def out_of_memory_hint(phase: str, config: EngineConfig) -> Iterator[None]:
    """``phase``: ``"model"`` (loading weights) or ``"kv"`` (profiling, the KV cache,
    CUDA graphs).  Re-raises an out-of-memory error as ``StartupMemoryError``."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        doing = "loading the model" if phase == "model" else "allocating the KV cache"
        raise StartupMemoryError(f"out of memory while {doing} on "
                                 f"{config.device_config.device}: "
                                 f"{_what_to_change(phase, config)}") from None


def cpu_memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux ``MemAvailable``);
    None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_cpu_kv_fits(kv_bytes: int, config: EngineConfig) -> None:
    """Raise ``StartupMemoryError`` if a CPU KV cache of ``kv_bytes`` exceeds the memory
    available now."""
    avail = cpu_memory_available()
    if avail is None or kv_bytes <= avail:
        return
    cc, mc, sc = config.cache_config, config.model_config, config.scheduler_config
    if cc.kv_cache_memory_bytes is not None:
        fix = f"lower --kv-cache-memory-bytes ({cc.kv_cache_memory_bytes}) to at most {avail}"
    else:  # the default size follows max_model_len x max_num_seqs
        fix = (f"pass --kv-cache-memory-bytes below {avail}, or lower --max-model-len "
               f"({mc.max_model_len}) or --max-num-seqs ({sc.max_num_seqs})")
    raise StartupMemoryError(
        f"kv_cache_memory_bytes: a KV cache of {kv_bytes / 2**30:.1f} GiB does not fit in "
        f"the {avail / 2**30:.1f} GiB of memory available: {fix}")
