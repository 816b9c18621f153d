"""Compile one C source at first use and load it with ctypes.

The CPU kernels (``pagedllm/cpu/csrc``, ``layers/quantization/csrc``) are plain C with
OpenMP, built by the system C compiler (``$CC``, else ``cc`` or ``gcc``) with ``-O3
-march=native -fopenmp`` into ``$PAGEDLLM_KERNEL_CACHE`` (default
``~/.cache/pagedllm/kernels``), keyed by the source, the flags and this CPU's feature
flags, so a second process (or a test run) loads the cached library without compiling;
the key covers the files a source ``#include "..."``s too (a kernel may include others).
The OpenMP runtime is the libgomp torch has already loaded, so the kernels share torch's
thread pool rather than starting a second one.

``load`` never raises: without a compiler, or when the build or the load fails, it logs
the reason once and returns None, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pagedllm.envs as envs

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()
# The C sources of the CPU kernels (``layers/quantization/csrc`` holds the int4 ones).
CSRC = Path(__file__).with_name("csrc")
_loaded: dict[Path, ctypes.CDLL | None] = {}


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _source_bytes(src: Path, seen: set[Path] | None = None) -> bytes:
    """``src`` and, recursively, every local file it ``#include "..."``s."""
    seen = set() if seen is None else seen
    if src in seen:
        return b""
    seen.add(src)
    text = src.read_bytes()
    out = text
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):
        out += _source_bytes((src.parent / name.decode()).resolve(), seen)
    return out


def _compile(src: Path, what: str) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("%s: no C compiler; the torch path runs instead", what)
        return None
    key = hashlib.sha256(_source_bytes(src) + " ".join([cc, *FLAGS]).encode()
                         + _cpu_key().encode())
    cache = Path(envs.kernel_cache_dir())
    so = cache / f"{src.stem}_{key.hexdigest()[:16]}.so"
    if so.exists():
        return so
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        subprocess.run([cc, *FLAGS, str(src), "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, so)  # atomic: concurrent builders never load a partial file
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        logger.info("%s: build failed (%s%s); the torch path runs instead", what, e,
                    (": " + err.decode(errors="replace")[-300:]) if err else "")
        return None
    return so


def load(src: Path, what: str,
         declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The library built from ``src`` (compiled on the first call of the process, cached
    on disk), after ``declare(lib)`` has set its functions' ``argtypes``/``restype``; None
    (logged once, as ``what``) when it cannot be built or loaded.  After the first call
    for ``src`` it is a dict lookup (kernels call it per use)."""
    if src in _loaded:
        return _loaded[src]
    with _lock:
        if src in _loaded:
            return _loaded[src]
        lib: ctypes.CDLL | None = None
        so = _compile(src, what)
        if so is not None:
            try:
                lib = ctypes.CDLL(str(so))
                declare(lib)
            except (OSError, AttributeError) as e:
                logger.info("%s: cannot load %s (%s)", what, so, e)
                lib = None
        _loaded[src] = lib
        return lib
