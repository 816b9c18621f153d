"""The start-up readahead of shared libraries (entrypoints/prefetch.py)."""

from __future__ import annotations

import os

import torch

from pagedllm.entrypoints.prefetch import _startup_files, prefetch_startup_files


def test_prefetch_covers_torch_and_finishes() -> None:
    files, pyc = _startup_files()
    torch_lib = os.path.dirname(torch.__file__)
    assert any(f.startswith(torch_lib) and "libtorch" in f for f in files)
    assert not any("cudnn" in os.path.basename(f) for f in files)
    sizes = [os.path.getsize(f) for f in files]
    assert sizes == sorted(sizes, reverse=True)  # largest first
    assert any("transformers" in f and f.endswith(".pyc") for f in pyc)
    thread = prefetch_startup_files()
    if thread is not None:  # Linux
        thread.join(timeout=60)
        assert not thread.is_alive()
