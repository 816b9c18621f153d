"""A fast, read-only view of a GGUF file: metadata, tensor directory, raw tensor bytes.

Why not ``gguf.GGUFReader``?  It builds a numpy memmap view for every part of every
metadata field, which for a 49k-token vocabulary (tokens + merges) costs ~4-7 s on a small
CPU.  The GGUF header is a simple little-endian stream, so we parse it with ``struct``
(~0.1 s) and keep the tensor data as one ``np.memmap``.  Dequantisation still uses the
``gguf`` package (``gguf.quants.dequantize``), and a test checks this reader against
``GGUFReader`` on the default model.

This module imports no torch: ``resolve.py`` (and through it ``config.py``) uses it.

Layout (GGUF v2/v3)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to ``general.alignment`` (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.model_files.safe_open import open_regular

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's directory entry.

    ``shape`` is in torch/numpy order (outermost first), i.e. GGUF's ``dims`` reversed:
    a HF ``[out, in]`` weight appears as ``(out, in)``.  ``data_offset`` is absolute.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data_offset: int
    n_bytes: int


class GGUFFile:
    """Parsed header of a GGUF file.

    ``metadata`` maps keys to Python values (arrays become lists, numeric arrays numpy
    arrays).  ``tensors`` keeps file order.  ``raw(info)`` returns the bytes of a tensor
    shaped the way ``gguf.quants.dequantize`` expects.  Raises ``ValueError`` (naming the
    file) on a truncated or non-GGUF file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            # mmap: the header is parsed in place; only the pages it spans are read.
            with (open_regular(path, "rb") as f,
                  mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m):
                self._buf = m
                try:
                    self._parse()
                finally:
                    self._buf = b""
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, ValueError) as e:
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path}: not a valid GGUF file (truncated or corrupt header: "
                             f"{e})") from e
        except OSError as e:
            raise ValueError(f"{path}: cannot read GGUF file: {e}") from e
        self._data: np.memmap | None = None

    # -- parsing ------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic {buf[:4]!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version} "
                             "(big-endian files are not supported either)")
        self.version = version
        off = 24
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, off = self._str(off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            value, off = self._value(vtype, off + 4)
            meta[key] = value
        self.metadata = meta
        tensors: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, off = self._str(off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            ggml_type, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            tensors.append((name, tuple(reversed(dims)), ggml_type, rel))
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = off + (-off) % align
        size = os.path.getsize(self.path)
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        infos = []
        for name, shape, ggml_type, rel in tensors:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            n_bytes = int(np.prod(shape)) * type_size // block
            start = self.data_start + rel
            if start + n_bytes > size:
                raise ValueError(f"{self.path}: truncated GGUF file (tensor {name} ends at "
                                 f"byte {start + n_bytes}, file has {size})")
            infos.append(GGUFTensorInfo(name, shape, ggml_type, start, n_bytes))
        self.tensors = infos

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, off)
        off += 8
        if off + n > len(self._buf):
            raise IndexError("string runs past the end of the header")
        return self._buf[off:off + n].decode("utf-8"), off + n

    def _value(self, vtype: int, off: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._str(off)
        if vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", self._buf, off)
            off += 12
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype]).newbyteorder("<")
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=off).copy()
                return arr, off + n * dt.itemsize
            items = []
            for _ in range(n):
                item, off = self._value(etype, off)
                items.append(item)
            return items, off
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        (v,) = struct.unpack_from(fmt, self._buf, off)
        return v, off + struct.calcsize(fmt)

    # -- data ---------------------------------------------------------------------------

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored data (a zero-copy memmap slice).

        float/int types come typed and shaped; quantised types come as uint8 with the last
        dimension in bytes -- exactly what ``gguf.quants.dequantize`` takes.
        """
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        if self._data is None:
            self._data = np.memmap(self.path, mode="r", dtype=np.uint8)
        # A plain ndarray view: numpy's memmap subclass costs a Python hook on every
        # slice that dequantisation takes (~30% of GGUF load time).
        chunk = self._data[info.data_offset:info.data_offset + info.n_bytes].view(np.ndarray)
        plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
        qtype = Q(info.ggml_type)
        if qtype in plain:
            return chunk.view(plain[qtype]).reshape(info.shape)
        return chunk.reshape(quant_shape_to_byte_shape(info.shape, qtype))

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

