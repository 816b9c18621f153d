"""Kernel tests run under the Triton interpreter unless a CUDA device is present.

The variable must be set before triton is imported anywhere, hence at conftest import.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_refs import DEVICE, ON_GPU  # noqa: E402  (after TRITON_INTERPRET is set)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (not under TRITON_INTERPRET)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE
