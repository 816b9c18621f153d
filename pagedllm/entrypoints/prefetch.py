"""Read what start-up imports ahead of the importer, in the background, when a server
starts.

On a machine's first start the page cache is empty.  Importing torch and transformers
(in the API process and in the engine core, both at once) then reads thousands of files
one at a time, each read waiting for the disk: on the H200 machine, 5.7 s to import torch
and 10.1 s to build the engine config (transformers) on a first start, against ~4 and
~3-5 s later.  This asks the kernel to read them now, from several threads so that many
reads are in flight at once: ``posix_fadvise(WILLNEED)`` on the shared libraries of
torch, the ``nvidia`` CUDA-library packages and triton (largest first, without cuDNN,
which is never loaded: no convolutions here), and on the compiled bytecode (``.pyc``) of
the pure-Python packages start-up imports.  Pages already cached cost nothing.  Only on
Linux; errors are ignored (this is a hint, never a requirement).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

# Packages whose shared libraries start-up loads.
_LIBRARY_PACKAGES = ("torch", "nvidia", "triton")
# Packages whose bytecode start-up imports (torch's too: ~2,000 modules at import).
_BYTECODE_PACKAGES = ("torch", "transformers", "sympy", "huggingface_hub", "tokenizers",
                      "safetensors", "numpy", "jinja2", "fastapi", "starlette", "pydantic",
                      "uvicorn", "triton", "gguf")
_THREADS = 8


def _package_dirs(package: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def _startup_files() -> tuple[list[str], list[str]]:
    """(shared libraries of ``_LIBRARY_PACKAGES``, largest first; this interpreter's
    ``.pyc`` files of ``_BYTECODE_PACKAGES``), each package's tree walked once."""
    tag = f".{sys.implementation.cache_tag}."
    libraries: list[tuple[int, str]] = []
    bytecode: list[str] = []
    for package in dict.fromkeys(_LIBRARY_PACKAGES + _BYTECODE_PACKAGES):
        want_libs = package in _LIBRARY_PACKAGES
        want_pyc = package in _BYTECODE_PACKAGES
        for location in _package_dirs(package):
            for root, _, names in os.walk(location):
                if want_pyc and os.path.basename(root) == "__pycache__":
                    bytecode.extend(os.path.join(root, n) for n in names if tag in n)
                if not want_libs:
                    continue
                for name in names:
                    if ".so" in name and "cudnn" not in name:
                        path = os.path.join(root, name)
                        try:
                            libraries.append((os.path.getsize(path), path))
                        except OSError:
                            continue
    return [path for _, path in sorted(libraries, reverse=True)], bytecode


def _advise(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _advise_all(paths: list[str]) -> None:
    """Advise ``paths`` from ``_THREADS`` daemon threads and wait for them.

    Plain daemon threads, not a ``ThreadPoolExecutor``: its workers are joined at
    interpreter exit and it refuses new work once shutdown starts, so a server that exits
    during start-up (a one-line refusal) would print that thread's traceback after its
    error line, or wait for the readahead to finish."""
    lock = threading.Lock()
    it = iter(paths)

    def work() -> None:
        while True:
            with lock:
                path = next(it, None)
            if path is None:
                return
            _advise(path)

    threads = [threading.Thread(target=work, name="pagedllm-prefetch", daemon=True)
               for _ in range(_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _prefetch() -> None:
    try:
        # Libraries first: each is one large sequential read.  Then the bytecode.
        for paths in _startup_files():
            _advise_all(paths)
    except BaseException:  # a hint, never a requirement (and never a traceback at exit)
        return


def prefetch_startup_files() -> threading.Thread | None:
    """Start the readahead in a daemon thread (returned, for tests); None where the
    platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_prefetch, name="pagedllm-prefetch", daemon=True)
    thread.start()
    return thread
