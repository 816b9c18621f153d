"""SiLU-and-multiply for float32 rows on the CPU in one C call (``csrc/silu_mul.c``).

``F.silu(g) * u`` is two torch ops and a temporary per call; this kernel is one pass,
and it is the activation the CPU decode stack (``models/cpu_decode_stack.py``) runs, so a step
computed module by module and one computed by the stack agree bit for bit.  Numerics:
``g / (1 + exp(-g)) * u`` with a polynomial ``exp`` of about 1 ulp (torch's is Sleef's,
also about 1 ulp: the two may differ in the last bit).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedllm.cpu import build

_SRC = Path(__file__).with_name("csrc") / "silu_mul.c"
_L = ctypes.c_long


def _declare(lib: ctypes.CDLL) -> None:
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, _L,
                             ctypes.c_void_p, _L]


def _lib() -> ctypes.CDLL | None:
    return build.load(_SRC, "CPU SiLU-and-multiply", _declare)


def applies(x: torch.Tensor) -> bool:
    """2-D float32 CPU rows of even width with unit inner stride, and the library built."""
    return (x.dtype is torch.float32 and x.dim() == 2 and not x.is_cuda
            and x.shape[1] % 2 == 0 and x.stride(-1) == 1 and _lib() is not None)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` as a new ``[T, d]`` tensor.  Needs ``applies``."""
    lib = _lib()
    assert lib is not None
    t, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, d, dtype=torch.float32)
    lib.silu_mul(t, d, x.data_ptr(), x.stride(0), out.data_ptr(), d)
    return out
