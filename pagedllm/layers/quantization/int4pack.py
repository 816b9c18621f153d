"""torch's packed-int4 weight kernels, on CPU and CUDA: pack, multiply, read rows back.

``w[n, k] = (v[n, k] - 8) * scale[n, k // g] + zero[n, k // g]``, ``v`` in [0, 15], group
``g`` in {32, 64, 128, 256}.  The kernels take ``x`` and the scale/zero pairs in bf16 (on
the CPU, bf16 is the dtype with a vectorised kernel: fp32 and fp16 run a scalar
reference path, ~30x slower at batch 1 on this machine) and accumulate in fp32:

* CPU: ``aten._convert_weight_to_int4pack_for_cpu`` / ``aten._weight_int4pack_mm_for_cpu``;
* CUDA: ``aten._convert_weight_to_int4pack`` / ``aten._weight_int4pack_mm`` (tinygemm).

A weight may be a sum of parts (a code wider than 4 bits split into nibbles,
``gguf_blocks.int4_parts``): ``x W^T = sum_p x W_p^T``.

The CPU packed layout (``[N, K/2]`` bytes): rows in tiles of 64, each tile ``64 * K / 2``
contiguous bytes, the nibbles inside a tile placed by the CPU's vector ISA (AVX-512:
byte ``(k // 2) * 64 + (k % 2) * 32 + n % 32``, low nibble for ``n % 64 < 32``; AVX2:
byte ``(n % 64 // 32) * K * 16 + k * 16 + n % 16``, low nibble for ``n % 32 < 16``).
``gather_rows`` reads it through a map taken from packing probe tiles on this machine
(``_tile_map``), so that an embedding can share its tied lm_head's storage whatever
the ISA.

On an x86 CPU with AVX512-VNNI or AVX2 (``int4_vnni.py``) a part is packed in that kernel's "vnni4"
layout instead (``layout == "vnni4"``; ``"vnni4x8"`` for a weight made with ``act8``,
whose products take int8 activations as ggml's do), and ``x`` goes in and comes out in
float32.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.layers.quantization import int4_vnni

ACT_DTYPE = torch.bfloat16
_TILE_N = 64
VNNI4 = ("vnni4", "vnni4x8")  # the int4_vnni kernel's int4 layouts


@functools.cache
def _tile_map(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(byte, shift)``, each ``[64, k]``: where torch's CPU packing puts ``v[n, k]`` of a
    64-row tile (its byte in the tile, and 0 or 4 for its nibble).  Read off packing probe
    tiles whose codes are the base-16 digits of each element's index, one probe a digit:
    the layout depends on the CPU's vector ISA (module doc), the probes see this one."""
    pos = torch.arange(_TILE_N * k, dtype=torch.int64).view(_TILE_N, k)
    found = torch.zeros(_TILE_N * k, dtype=torch.int64)  # index stored at each nibble
    digit = 0
    while (_TILE_N * k) >> (4 * digit):
        probe = ((pos >> (4 * digit)) & 0x0F).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2).flatten()
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten().to(torch.int64)
        found |= nibbles << (4 * digit)
        digit += 1
    where = torch.empty_like(found)
    where[found] = torch.arange(found.numel())  # nibble slot of each element index
    where = where.view(_TILE_N, k)
    return where // 2, ((where % 2) * 4).to(torch.uint8)


class PackedInt4:
    """One int4 part on one device: ``packed`` (the kernel's layout: ``layout`` is
    ``"torch"`` or, on VNNI CPUs, ``"vnni4"``, or ``"vnni4x8"`` with ``act8``: the
    activations quantised to int8 per 32 columns instead of int16, ``int4_vnni.py``) and
    ``scale_zero`` ``[K/g, N, 2]`` bf16."""

    def __init__(self, v: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int, device: torch.device, act8: bool = False) -> None:
        n, k = v.shape
        if k % group or group not in (32, 64, 128, 256):
            raise ValueError(f"int4 group {group} must be 32, 64, 128 or 256 and divide "
                             f"K={k}")
        self.n, self.k, self.group = n, k, group
        self.device = torch.device(device)
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(
            device=self.device, dtype=ACT_DTYPE)
        self.layout = "torch"
        if self.device.type == "cpu" and int4_vnni.packable(n, k, group) \
                and int4_vnni.available():
            self.layout = "vnni4x8" if act8 else "vnni4"
            self.packed = int4_vnni.pack(v, act8)
        elif self.device.type == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                v.to(torch.int32).contiguous(), 2)
        else:
            pairs = (v[:, 0::2] << 4 | v[:, 1::2]).to(torch.uint8).contiguous()
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(self.device),
                                                                     tiles)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` bf16 -> ``[M, N]`` bf16 (float32 in and out for the vnni layouts)."""
        if self.layout in VNNI4:
            return int4_vnni.mm(x, [self])
        if self.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                              self.scale_zero)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scale_zero)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale_zero]

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes ``v[ids]`` as uint8 ``[T, K]`` (CPU layout only; module doc)."""
        if self.layout in VNNI4:
            return int4_vnni.gather_rows(self.packed, self.n, self.k, ids,
                                         self.layout == "vnni4x8")
        if self.device.type != "cpu" or self.n % _TILE_N:
            raise ValueError("gather_rows needs the CPU layout and N % 64 == 0")
        byte, shift = _tile_map(self.k)
        tiles = self.packed.view(self.n // _TILE_N, _TILE_N * self.k // 2)
        r = ids % _TILE_N
        b = tiles[(ids // _TILE_N)[:, None], byte[r]]  # [T, K]
        return (b >> shift[r]) & 0x0F


class PackedInt8:
    """A weight of 8-bit codes on a VNNI CPU: ``w[n, k] = (v[n, k] - 128) * scale[n, k // g]
    + zero[n, k // g]``, ``v`` in [0, 255], ``packed`` in ``int4_vnni``'s "vnni8" layout,
    ``scale_zero`` ``[K/g, N, 2]`` bf16 as ``PackedInt4``'s (``"vnni8x8"`` with ``act8``,
    int8 activations).  ``mm_parts`` takes it as a one-part list.  Needs
    ``int4_vnni.available()``, ``N % 16 == 0``, ``K % 32 == 0``."""

    def __init__(self, v: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int, act8: bool = False) -> None:
        n, k = v.shape
        self.n, self.k, self.group = n, k, group
        self.device = torch.device("cpu")
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(
            ACT_DTYPE)
        self.layout = "vnni8x8" if act8 else "vnni8"
        self.packed = int4_vnni.pack8(v, act8)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` float32."""
        return int4_vnni.mm8(x, self)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale_zero]

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes ``v[ids]`` as uint8 ``[T, K]``."""
        return int4_vnni.gather_rows8(self.packed, self.n, self.k, ids,
                                      self.layout == "vnni8x8")


def mm_parts(x: torch.Tensor, parts: list[PackedInt4]) -> torch.Tensor:
    """``sum_p x W_p^T`` in ``x``'s dtype (``x`` goes in as bf16; parts are summed in
    fp32).  Parts in a vnni layout take ``int4_vnni`` for every M; torch's layout its
    int4 kernel."""
    if parts[0].layout in VNNI4:
        return int4_vnni.mm(x, parts).to(x.dtype)
    if parts[0].layout in ("vnni8", "vnni8x8"):
        return parts[0].mm(x).to(x.dtype)
    xb = x.to(ACT_DTYPE)
    y = parts[0].mm(xb)
    if len(parts) == 1:
        return y.to(x.dtype)
    acc = y.float()
    for p in parts[1:]:
        acc += p.mm(xb)
    return acc.to(x.dtype)


def packable(n: int, k: int, device: torch.device) -> bool:
    """Whether an ``[n, k]`` weight fits the kernels' shape rules (CPU: N % 16; CUDA:
    N % 8; both K % 32)."""
    return k % 32 == 0 and n % (16 if torch.device(device).type == "cpu" else 8) == 0


def gatherable(n: int, device: torch.device) -> bool:
    """Whether ``gather_rows`` can read this part's rows."""
    return torch.device(device).type == "cpu" and n % _TILE_N == 0


def cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
