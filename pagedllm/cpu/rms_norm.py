"""RMSNorm (+ residual add) for float32 rows on the CPU in one C call
(``csrc/rms_norm.c``).

``torch.nn.functional.rms_norm`` on the CPU runs as five or six small ops (~14 us for
one 576-wide row on this project's test machine, and a decoder step has two norms per
layer); this kernel is one pass over the row.  Numerics: the mean of squares in
float64, then ``w * (s * rsqrt)`` in float32 -- HF's order, with a more exact mean.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedllm.cpu import build

_SRC = Path(__file__).with_name("csrc") / "rms_norm.c"
_P = ctypes.c_void_p
_L = ctypes.c_long


def _declare(lib: ctypes.CDLL) -> None:
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [ctypes.c_int, ctypes.c_int, _P, _L, _P, _L, _P, ctypes.c_float,
                             _P, _L, _P, _L]


def _lib() -> ctypes.CDLL | None:
    return build.load(_SRC, "CPU RMSNorm", _declare)


def applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """2-D float32 CPU rows with unit inner stride (and a residual of the same shape),
    a contiguous float32 weight, and the library built."""
    return (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.dim() == 2
            and not x.is_cuda and x.stride(-1) == 1 and weight.is_contiguous()
            and (residual is None or (residual.dtype is torch.float32
                                      and residual.shape == x.shape
                                      and residual.stride(-1) == 1))
            and _lib() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward``'s contract: the normed ``x``, or with ``residual`` the pair
    ``(normed x + residual, x + residual)`` as new tensors.  Needs ``applies``."""
    lib = _lib()
    assert lib is not None
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.float32)
    if residual is None:
        lib.rms_norm(t, h, x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), eps,
                     out.data_ptr(), h, None, 0)
        return out
    total = torch.empty(t, h, dtype=torch.float32)
    lib.rms_norm(t, h, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                 weight.data_ptr(), eps, out.data_ptr(), h, total.data_ptr(), h)
    return out, total
