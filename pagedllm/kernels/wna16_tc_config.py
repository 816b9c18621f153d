"""Launch table of the W4A16 tensor-core GEMM (``kernels/wna16_tc.py``): which path a
``(M, N, K)`` takes from ``tc_min_m`` rows up, and the kernel's configuration.

A table is written by ``benchmarks/wna16_tc_sweep.py`` (``--table``) and shipped as
``kernels/tuned/wna16_tc_<device name>.json`` (``PAGEDLLM_WNA16_TC_CONFIGS`` overrides):

```
 {"configs": [[m, n, k, "tc", [block_m, block_n, block_k, group_m, warps, stages,
                              split_k, swap, scale_after]],
              [m, n, k, "dequant", null], ...],
  "summary": {"tc_min_m": 16, ...}}
```

An entry serves every ``M`` up to its ``m`` (the smallest swept ``m >= M`` at that
``(n, k)``; above the largest, the largest).  ``"dequant"`` means the measured winner
there was dequantise + cuBLAS (``int_cuda.dequant_linear``).  Shapes not in the table get
priors (the usual Hopper Triton tiles; not measured, not GPU-checked: ``int_cuda`` never
routes to them -- only direct :func:`w4a16_tc_gemm` calls without a config use them).
Without a table the kernel is off (:func:`tc_min_m` is 0).  Everything is keyed by host ints:
a CUDA-graph capture and an eager run of one batch size pick the same path.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.kernels.int8_gemm import target_programs
from pagedllm.kernels.tuned_tables import load_tuned_table

# (block_m, block_n, block_k, group_m, warps, stages, split_k, swap, scale_after)
TcConfig = tuple[int, int, int, int, int, int, int, int, int]
Choice = tuple[str, "TcConfig | None"]
DEFAULT_TC_MIN_M = 16


@functools.cache
def _tuned_file() -> dict:
    return load_tuned_table("wna16_tc")


def tuned_summary() -> dict:
    """The table's ``summary`` (the sweep's per-step totals and recommended settings)."""
    return _tuned_file().get("summary", {})


@functools.cache
def _table() -> dict[tuple[int, int], list[tuple[int, Choice]]]:
    """``(n, k) -> [(m, choice), ...]`` sorted by ``m``."""
    out: dict[tuple[int, int], list[tuple[int, Choice]]] = {}
    for m, n, k, kind, cfg in _tuned_file().get("configs", []):
        if kind not in ("tc", "dequant"):
            raise ValueError(f"PAGEDLLM_WNA16_TC_CONFIGS: unknown path {kind!r}")
        choice = (kind, None if cfg is None else tuple(int(v) for v in cfg))
        out.setdefault((int(n), int(k)), []).append((int(m), choice))  # type: ignore[arg-type]
    for v in out.values():
        v.sort(key=lambda e: e[0])
    return out


def has_table() -> bool:
    """Whether a tuned table (``PAGEDLLM_WNA16_TC_CONFIGS`` or the shipped one) is
    present: its configurations passed the sweep's GPU check; nothing else did."""
    return bool(_tuned_file().get("configs"))


def tc_min_m() -> int:
    """The rows from which this module picks the path (0: the kernel is off): the table's
    ``summary["tc_min_m"]`` (16 if it has none), else 0 -- without a table the kernel is
    off: only GPU-checked configurations are ever routed to (``int_cuda._tc_route``), so
    its K-major copy would be dead weight."""
    if not has_table():
        return 0
    tuned = _tuned_file().get("summary", {}).get("tc_min_m")
    return DEFAULT_TC_MIN_M if tuned is None else int(tuned)


def auto_split(m: int, n: int, k: int, bm: int, bn: int, bk: int,
               device: torch.device) -> int:
    """Split-K that brings the grid up to the device's target program count (narrow
    outputs at small M), at most 16 and whole K steps."""
    programs = -(-m // bm) * -(-n // bn)
    return max(1, min(target_programs(device) // programs, k // bk, 16))


def prior_config(m: int, n: int, k: int, device: torch.device) -> TcConfig:
    """Priors (compile-checked for sm_90): the rows as wgmma's N dimension (``swap``: the
    dequantised weight tile is the register A operand, so the wgmmas stay in flight while
    the next tile is dequantised) at every M, and 128-input K tiles: they take the
    packed-half unpack (``wna16_tc``), and on an H100 (2026-12-07) several 64-input
    tiles gave results that differed run to run or between the two unpacks."""
    if m <= 16:
        bm, bn, bk, gm, warps, stages = 16, 128, 128, 1, 4, 4
    elif m <= 32:
        bm, bn, bk, gm, warps, stages = 32, 128, 128, 4, 4, 4
    elif m <= 64:
        bm, bn, bk, gm, warps, stages = 64, 128, 128, 4, 4, 3
    else:
        bm, bn, bk, gm, warps, stages = 128, 128, 128, 8, 8, 3
    return (bm, bn, bk, gm, warps, stages, auto_split(m, n, k, bm, bn, bk, device), 1, 0)


@functools.lru_cache(maxsize=4096)  # eager (prefill) steps call it per layer
def tc_choice(m: int, n: int, k: int, device: torch.device) -> Choice:
    """``("tc", config)`` or ``("dequant", None)`` for ``m`` rows from the table (module
    doc); ``("prior", config)`` where the table has no entry for ``(n, k)`` (the caller
    decides: ``int_cuda`` keeps its measured dequantise threshold then)."""
    entries = _table().get((n, k))
    if entries:
        for tm, choice in entries:
            if tm >= m:
                return choice
        return entries[-1][1]
    return "prior", prior_config(m, n, k, device)


def tc_config(m: int, n: int, k: int, device: torch.device) -> TcConfig:
    """The kernel's configuration for ``m`` rows: the table's where it picked the kernel,
    else the priors."""
    kind, cfg = tc_choice(m, n, k, device)
    return cfg if kind != "dequant" and cfg is not None else prior_config(m, n, k, device)
