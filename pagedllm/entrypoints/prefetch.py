"""Read torch's shared libraries ahead, in the background, when a server starts.

On a machine's first start the page cache is empty, and importing torch (in the API
process and in the engine core, both at once) faults its shared libraries in one
readahead window at a time: on the H200 machine, 14-18 s from spawning the engine core
to a loaded model on a first start against 9-13 s later.  ``posix_fadvise(WILLNEED)``
asks the kernel to read whole files now, in large sequential requests, while Python is
still importing the rest; pages already cached cost nothing.

Which files: the ``.so`` files of torch, the ``nvidia`` CUDA-library packages and
triton, largest first, without cuDNN (never loaded: no convolutions here).  Only on
Linux; errors are ignored (this is a hint, never a requirement).
"""

from __future__ import annotations

import importlib.util
import os
import threading


def _library_files() -> list[str]:
    files: list[tuple[int, str]] = []
    for package in ("torch", "nvidia", "triton"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            for root, _, names in os.walk(location):
                for name in names:
                    if ".so" in name and "cudnn" not in name:
                        path = os.path.join(root, name)
                        try:
                            files.append((os.path.getsize(path), path))
                        except OSError:
                            continue
    return [path for _, path in sorted(files, reverse=True)]


def _advise(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def prefetch_shared_libraries() -> threading.Thread | None:
    """Start the readahead in a daemon thread (returned, for tests); None where the
    platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=lambda: _advise(_library_files()),
                              name="pagedllm-prefetch", daemon=True)
    thread.start()
    return thread
