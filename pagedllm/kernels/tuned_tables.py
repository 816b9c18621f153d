"""Launch tables swept on one GPU model: shipped with the package as
``kernels/tuned/<prefix>_<device name>.json`` (as vLLM ships its fused-MoE tables), or
named by an environment variable for an A/B run."""

from __future__ import annotations

import json
import os

import torch


def shipped_table(prefix: str) -> str | None:
    """The shipped table of this GPU model for ``prefix``, if there is one."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().replace(" ", "_")
    path = os.path.join(os.path.dirname(__file__), "tuned", f"{prefix}_{name}.json")
    return path if os.path.exists(path) else None


def load_tuned_table(prefix: str, env: str) -> dict:
    """The table ``$env`` names, else the shipped one, else ``{}``; a file that cannot be
    read is a ``ValueError`` naming the variable."""
    path = os.environ.get(env) or shipped_table(prefix)
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{env}: cannot read {path!r}: {e}") from None
