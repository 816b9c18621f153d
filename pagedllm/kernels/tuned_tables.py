"""Launch tables swept on one GPU model: shipped with the package as
``kernels/tuned/<prefix>_<device name>.json`` (as vLLM ships its fused-MoE tables), or
named by an environment variable (``envs.TUNED_TABLE_ENV``: a table a sweep in
``benchmarks/`` wrote for another GPU model)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TypeVar

import torch

import pagedllm.envs as envs

T = TypeVar("T")


def shipped_table(prefix: str) -> str | None:
    """The shipped table of this GPU model for ``prefix``, if there is one."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().replace(" ", "_")
    path = os.path.join(os.path.dirname(__file__), "tuned", f"{prefix}_{name}.json")
    return path if os.path.exists(path) else None


def table_path(prefix: str) -> str | None:
    """The table the environment names for ``prefix``, else the shipped one, else None."""
    return envs.tuned_table_path(prefix) or shipped_table(prefix)


def load_tuned_table(prefix: str) -> dict:
    """The table of :func:`table_path`, else ``{}``; a file that cannot be read is a
    ``ValueError`` naming the variable."""
    path = table_path(prefix)
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{envs.TUNED_TABLE_ENV[prefix]}: cannot read {path!r}: {e}"
                         ) from None


def smallest_fit(table: Mapping[tuple[int, int, int], T], m: int, n: int, k: int) -> T | None:
    """The entry of ``table`` (keyed ``(m, n, k)``) for the smallest swept row count
    ``>= m`` at ``(n, k)``, else None: how the sweeps' per-shape tables are read."""
    fits = [tm for (tm, tn, tk) in table if (tn, tk) == (n, k) and tm >= m]
    return table[(min(fits), n, k)] if fits else None
