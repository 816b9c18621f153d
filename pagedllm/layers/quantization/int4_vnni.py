"""The CPU int4 GEMM for packed int4 weights on x86 CPUs with AVX512-VNNI or AVX2
(``csrc/int4_vnni.c``, ``csrc/int4_avx2.h``).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) converts every weight to
float32 and multiplies in float32 for every 4 rows of ``x``: on this project's 2-core
test machine it reads the default model's 81 MB of codes at ~10 GB/s at batch 1 and
costs ~8 ms per token hot (13 ms in the model), the largest share of a decode step.
This kernel keeps the weights as 4-bit codes in a layout of its own ("vnni4", see the C
file), quantises each row of ``x`` to int16 per 32 columns and multiplies with
``vpdpwssd``, 32 exact integer products per instruction, scaling by the weight's float32
scale and zero per group.

Numerics: the activations' int16 rounding (at most 2^-16 of each 32-column block's
largest value) replaces the int4 kernel's bf16 rounding (2^-9 relative); the weights are
exactly the format's (scale and zero as stored, in bf16).  A row's result depends on that
row alone: the same for any number of rows, any thread count.

Weights packed with ``act8`` (GGUF's, by default: ``gguf.act8``) take int8 activations
instead, as ggml computes its own block types: ``vpdpbusd`` multiplies 64 codes by int8
x per instruction without widening, about 1.5x the int16 path on the default model's
projections.  On that model (``bench perplexity``, 4,096 tokens) the GGUF path against
the float32 dequantised one moves perplexity by +0.36% with int8 activations and by
-0.03% with int16 (``docs/benchmarks.md``).

A table of 8-bit codes (a GGUF Q8_0 embedding and LM head: ``int4pack.PackedInt8``)
takes ``mm8``, the same scheme with one byte per weight ("vnni8" layout, "vnni8x8" with
int8 activations): as two int4 parts it would cost twice the instructions for the same
bytes.

Used for every ``PackedInt4`` on a CPU whose kernel builds and reports support (the
layout is chosen when the weight is packed); elsewhere torch's layout and kernel.  The
layouts and sums are the same on both instruction sets: AVX2 (AMD Zen 1-3, Intel before
Ice Lake) takes ``vpmaddubsw`` + ``vpmaddwd`` where VNNI takes ``vpdpbusd`` (int8 x) and
``vpmaddwd`` + an add for ``vpdpwssd`` (int16 x), 8 rows a register instead of 16.  On an
AVX2-only EPYC (2 cores, 2026-12-06) it took the default model's C1 from 29.4 to 56.3
output tok/s at batch 1 and from 75.5 to 167.7 at 64 concurrent, against torch's int4
kernel (``docs/benchmarks.md``).  :func:`force_avx2` runs the AVX2 kernels on a VNNI CPU
(tests: both paths on one machine).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pagedllm.cpu import build

_SRC = Path(__file__).with_name("csrc") / "int4_vnni.c"
MAX_PARTS = 4  # csrc/int4_vnni.c
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_long


def _declare(lib: ctypes.CDLL) -> None:
    lib.int4_vnni_supported.restype = _I
    lib.int4_vnni_supported.argtypes = []
    lib.int4_vnni_force_avx2.restype = _I
    lib.int4_vnni_force_avx2.argtypes = [_I]
    lib.int4_vnni_pack.restype = _I
    lib.int4_vnni_pack.argtypes = [_P, _I, _I, _P, _I]
    lib.int4_vnni_gemm.restype = _I
    lib.int4_vnni_gemm.argtypes = [_I, _P, _P, _I, _I, _I, _P, _L, _I, _P, _L, _I, _I]
    lib.int8_vnni_pack.restype = _I
    lib.int8_vnni_pack.argtypes = [_P, _I, _I, _P, _I]
    lib.int8_vnni_gemm.restype = _I
    lib.int8_vnni_gemm.argtypes = [_P, _P, _I, _I, _I, _P, _L, _I, _P, _L, _I, _I]


@functools.cache  # the CPU check too: once per process, not per GEMM
def _lib() -> ctypes.CDLL | None:
    lib = build.load(_SRC, "CPU int4 VNNI GEMM", _declare)
    return lib if lib is not None and lib.int4_vnni_supported() else None


def available() -> bool:
    """Whether CPU int4 weights take this kernel: the library built, and this CPU has
    AVX512-VNNI or AVX2 + FMA."""
    return _lib() is not None


def force_avx2(on: bool) -> bool:
    """Run the AVX2 kernels even on a VNNI CPU (``on``), or the CPU's best again; for
    tests, which compare both paths on one machine.  Whether the library has the AVX2
    kernels (False: nothing changed).  Process-wide; not for concurrent use."""
    lib = _lib()
    return lib is not None and bool(lib.int4_vnni_force_avx2(int(on)))


def packable(n: int, k: int, group: int) -> bool:
    """Whether an ``[n, k]`` weight of group ``group`` fits the layout."""
    return n % 32 == 0 and k % 32 == 0 and group % 32 == 0 and k % group == 0


def pack(v: torch.Tensor, act8: bool = False) -> torch.Tensor:
    """Codes ``v [N, K]`` (0..15, any integer dtype) -> the vnni4 bytes ``[N * K / 2]``
    uint8 (vnni4x8 with ``act8``: for int8 activations).  Needs ``available()`` and
    ``packable``."""
    lib = _lib()
    assert lib is not None
    n, k = v.shape
    codes = v.to(torch.uint8).contiguous()
    out = torch.empty(n * k // 2, dtype=torch.uint8)
    if lib.int4_vnni_pack(codes.data_ptr(), n, k, out.data_ptr(), int(act8)) != 0:
        raise ValueError(f"int4 vnni4 layout needs N % 32 == 0 and K % 32 == 0, got "
                         f"[{n}, {k}]")
    return out


def gather_rows(packed: torch.Tensor, n: int, k: int, ids: torch.Tensor,
                act8: bool = False) -> torch.Tensor:
    """The codes ``v[ids]`` as uint8 ``[T, K]`` read back from the vnni4 bytes (vnni4x8
    with ``act8``; an embedding shares its tied LM head's storage this way)."""
    r = ids % 32
    if act8:
        b = packed.view(n // 32, k // 4, 16, 4)[ids // 32, :, r % 16, :]  # k = 4 q + j
    else:
        b = packed.view(n // 32, k // 4, 2, 16, 2)[ids // 32, :, :, r % 16, :]  # 4q + 2h + j
    shift = ((r >= 16).to(torch.uint8) * 4).view(-1, 1)
    return (b.reshape(ids.shape[0], k) >> shift) & 0x0F


def mm(x: torch.Tensor, parts: list[Any]) -> torch.Tensor:
    """``x [M, K]`` float32 -> ``x (sum_p W_p)^T [M, N]`` float32 for ``PackedInt4`` parts
    (typed ``Any``: int4pack imports this module) in the vnni4 layout, all of one shape
    and group; any number of them (the kernel takes ``MAX_PARTS`` per call)."""
    if len(parts) > MAX_PARTS:
        return sum((mm(x, parts[i:i + MAX_PARTS]) for i in range(0, len(parts), MAX_PARTS)),
                   torch.zeros(x.shape[0], parts[0].n))
    lib = _lib()
    assert lib is not None
    p0 = parts[0]
    xc = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    m = xc.shape[0]
    y = torch.empty(m, p0.n, dtype=torch.float32)
    if m == 0:
        return y
    packed = (ctypes.c_void_p * len(parts))(*[p.packed.data_ptr() for p in parts])
    sz = (ctypes.c_void_p * len(parts))(*[p.scale_zero.data_ptr() for p in parts])
    rc = lib.int4_vnni_gemm(len(parts), packed, sz, p0.n, p0.k, p0.group, xc.data_ptr(),
                            xc.stride(0), m, y.data_ptr(), y.stride(0),
                            torch.get_num_threads(), int(p0.layout == "vnni4x8"))
    _check(rc, "int4", p0, len(parts))
    return y


def _check(rc: int, bits: str, part: Any, nparts: int) -> None:
    """A kernel's return code as the exception it means (0: nothing)."""
    if rc == -2:
        raise MemoryError(f"{bits} VNNI GEMM: cannot allocate the activation buffer")
    if rc != 0:
        raise ValueError(f"{bits} VNNI GEMM: bad arguments n={part.n} k={part.k} "
                         f"g={part.group} parts={nparts}")


def pack8(v: torch.Tensor, act8: bool = False) -> torch.Tensor:
    """Codes ``v [N, K]`` (0..255) -> the vnni8 bytes ``[N * K]`` uint8 (vnni8x8 with
    ``act8``).  Needs ``available()``, ``N % 16 == 0`` and ``K % 32 == 0``."""
    lib = _lib()
    assert lib is not None
    n, k = v.shape
    codes = v.to(torch.uint8).contiguous()
    out = torch.empty(n * k, dtype=torch.uint8)
    if lib.int8_vnni_pack(codes.data_ptr(), n, k, out.data_ptr(), int(act8)) != 0:
        raise ValueError(f"int8 vnni8 layout needs N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    return out


def gather_rows8(packed: torch.Tensor, n: int, k: int, ids: torch.Tensor,
                 act8: bool = False) -> torch.Tensor:
    """The codes ``v[ids]`` as uint8 ``[T, K]`` read back from the vnni8 bytes (vnni8x8
    with ``act8``)."""
    w = 4 if act8 else 2
    runs = packed.view(n // 16, k // w, 16, w)
    return runs[ids // 16, :, ids % 16, :].reshape(ids.shape[0], k)


def mm8(x: torch.Tensor, part: Any) -> torch.Tensor:
    """``x [M, K]`` float32 -> ``x W^T [M, N]`` float32 for one ``PackedInt8`` (typed
    ``Any``: int4pack imports this module)."""
    lib = _lib()
    assert lib is not None
    xc = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    m = xc.shape[0]
    y = torch.empty(m, part.n, dtype=torch.float32)
    if m == 0:
        return y
    rc = lib.int8_vnni_gemm(part.packed.data_ptr(), part.scale_zero.data_ptr(), part.n,
                            part.k, part.group, xc.data_ptr(), xc.stride(0), m, y.data_ptr(),
                            y.stride(0), torch.get_num_threads(),
                            int(part.layout == "vnni8x8"))
    _check(rc, "int8", part, 1)
    return y
