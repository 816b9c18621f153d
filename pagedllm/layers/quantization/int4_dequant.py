"""Large-M CPU path for packed-int4 weights: dequantise into a bf16 scratch, one GEMM.

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) dequantises the weight again
for every 4 rows of ``x`` and multiplies in fp32, so its cost grows linearly with M; on a
CPU with avx512_bf16 (and no AMX) a oneDNN bf16 GEMM on dense weights is ~2x faster than
fp32 MKL and ~2-3x faster than the int4 kernel at M=64 (docs/benchmarks.md, "CPU: the
GGUF kept quantised").  For ``M >= DEQUANT_MIN_ROWS`` rows this module dequantises the
packed parts of one layer (at most ``CHUNK_COLS`` output columns at a time, so the LM
head's 49152 rows never exist densely) into a reusable per-thread scratch ``W^T`` in
bf16 and multiplies with ``torch.mm``.  The weights stay quantised in memory; the scratch
is at most ``K * CHUNK_COLS`` bf16 values (4.5 MiB at K = 576).

Numerics: ``w = sum_p (v_p - 8) * scale_p + zero_p`` is computed in fp32 from the same
bf16 scale/zero the int4 kernel reads and rounded once to bf16 (relative error <= 2^-9
per weight; the int4 kernel keeps it in fp32); products accumulate in fp32 in both.

The dequantiser is ``csrc/int4_dequant.c``, compiled at first use by ``cpu/build.py``
(the system C compiler, ``-O3 -march=native -fopenmp``, cached on disk).  Without a compiler,
or if the build fails, ``available()`` is False and every M stays on the int4 kernel
(logged once); so do CPUs without native bf16 GEMMs (no avx512_bf16 or AMX: there a
bf16 GEMM is emulated).

**Opt-in** (``PAGEDLLM_INT4_DEQUANT=1``): a row's result then depends on how many rows
share its step (the scratch rounds weights to bf16, the int4 kernel keeps them in fp32),
so a request's greedy tokens can differ between running alone and in a batch at
near-ties -- against the project's batched-equals-alone rule, which the default keeps.
Measured gain: ~1.8x less CPU per step at 64 requests (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from pagedllm.cpu import build

logger = logging.getLogger(__name__)

# Measured crossover (benchmarks/int4_cpu_gemm.py, docs/benchmarks.md): at 8 rows the
# int4 kernel wins (the dequantisation is not amortised); from 16 rows dequant + bf16
# GEMM is as fast or faster at every projection of the default model, ~2x at 64.
DEQUANT_MIN_ROWS = 16
CHUNK_COLS = 4096  # output columns per scratch fill (a multiple of 64)
MAX_PARTS = 4  # csrc/int4_dequant.c

_SRC = Path(__file__).with_name("csrc") / "int4_dequant.c"
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
_local = threading.local()


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.int4_dequant_t
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]


def _build() -> ctypes.CDLL | None:
    return build.load(_SRC, "int4 dequantiser (large batches use the int4 kernel)",
                      _declare)


def _fast_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX): elsewhere a bf16
    GEMM is emulated and slower than the int4 kernel, so the path stays off."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return torch.backends.mkldnn.is_available() and any(
        getattr(cpu, c, lambda: False)() for c in checks)


def available() -> bool:
    """Whether the path is on: ``PAGEDLLM_INT4_DEQUANT=1``, a CPU with native bf16 GEMMs,
    and the dequantiser built and loaded (built on the first call)."""
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("PAGEDLLM_INT4_DEQUANT", "0") == "1" and _fast_bf16_gemm():
                    _lib = _build()
                    if _lib is not None:
                        logger.info("CPU int4 weights: batches of >= %d rows dequantise "
                                    "into a bf16 scratch and run one bf16 GEMM",
                                    DEQUANT_MIN_ROWS)
                _tried = True
    return _lib is not None


def supports(parts: list[Any]) -> bool:
    """Whether these ``int4pack.PackedInt4`` parts (typed ``Any``: int4pack imports this
    module) can take this path (torch's CPU layout, N % 64 == 0, <= 4 parts)."""
    p0 = parts[0]
    return (len(parts) <= MAX_PARTS and p0.layout == "torch" and p0.device.type == "cpu"
            and p0.n % 64 == 0
            and all((p.n, p.k, p.group) == (p0.n, p0.k, p0.group) for p in parts))


def dequant_t(parts: list[Any], out: torch.Tensor, n0: int, n1: int) -> None:
    """Write ``W^T[:, n0:n1]`` (bf16, ``W = sum of parts``) into ``out [K, >= n1 - n0]``
    (row-major, ``out.stride(0)`` is the row stride).  Needs ``available()`` and
    ``supports(parts)``; ``n0``, ``n1`` multiples of 64."""
    assert _lib is not None
    p0 = parts[0]
    if out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.shape[0] != p0.k:
        raise ValueError("out must be a bf16 [K, cols] tensor with unit column stride")
    packed = (ctypes.c_void_p * len(parts))(*[p.packed.data_ptr() for p in parts])
    sz = (ctypes.c_void_p * len(parts))(*[p.scale_zero.data_ptr() for p in parts])
    rc = _lib.int4_dequant_t(len(parts), packed, sz, p0.n, p0.k, p0.group, out.data_ptr(),
                             out.stride(0), n0, n1, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"int4 dequant: bad arguments n={p0.n} k={p0.k} g={p0.group} "
                         f"cols [{n0}, {n1})")


def _scratch(numel: int) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _local.buf = torch.empty(numel, dtype=torch.bfloat16)
    return buf


def mm(x: torch.Tensor, parts: list[Any]) -> torch.Tensor:
    """``x [M, K]`` bf16 -> ``x W^T [M, N]`` bf16 through the scratch (module doc)."""
    n, k = parts[0].n, parts[0].k
    cols = min(n, CHUNK_COLS)
    w = _scratch(k * cols)
    if cols == n:
        wt = w[:k * n].view(k, n)
        dequant_t(parts, wt, 0, n)
        return torch.mm(x, wt)
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, cols):
        n1 = min(n, n0 + cols)
        wt = w[:k * (n1 - n0)].view(k, n1 - n0)
        dequant_t(parts, wt, n0, n1)
        y[:, n0:n1] = torch.mm(x, wt)
    return y
