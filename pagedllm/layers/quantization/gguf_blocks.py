"""GGUF quantised blocks in torch: exact dequantisation and an exact int4 decomposition.

A GGUF weight row of ``K`` values is ``K / block`` blocks of bytes (``gguf.constants
.GGML_QUANT_SIZES``).  For each supported type this module reads the blocks of a whole
``[N, row_bytes]`` uint8 tensor at once (vectorised, never a loop over blocks) and gives

* ``dequantize(raw, qtype, k)``: float32 ``[N, K]``, computed with the same float32
  operations in the same order as ``gguf.quants.dequantize`` so the result is bitwise
  equal (a test checks every type);
* ``int4_parts(raw, qtype, k)``: the weight as a sum of int4 "parts" in the affine form of
  torch's packed-int4 kernels, ``w = sum_p (v_p - 8) * scale_p + zero_p`` with
  ``v_p in [0, 15]`` and one ``(scale, zero)`` per 32 consecutive values of a row.  This
  is exact in real arithmetic; only the kernels' rounding of scale and zero to their
  activation dtype (bf16) is lost.  Types with more than 4 bits split each code into its
  low and high nibble (``q = lo + 16 * hi``), i.e. two parts.

| type | block | value | parts |
|---|---|---|---|
| Q4_0 | 32 | ``d * (q - 8)`` | ``(q, d, 0)`` |
| Q4_1 | 32 | ``d * q + m`` | ``(q, d, m + 8d)`` |
| Q8_0 | 32 | ``d * q``, q int8 | ``(lo, d, 8d)``, ``(hi, 16d, 0)`` of ``q + 128`` |
| Q4_K | 256 (8 x 32) | ``d*sc * q - dmin*m`` | ``(q, s, 8s - dm)`` |
| Q5_K | 256 (8 x 32) | same, q 5-bit | ``(lo, s, 8s - dm)``, ``(hi + 8, 16s, 0)`` |
| Q6_K | 256 (16 x 16) | ``d*sc * (q - 32)`` | none: 16-value groups have no int4 kernel |

Raises ``ValueError`` on a row of the wrong byte length or a non-finite block scale
(a corrupt tensor), naming ``what``.
"""

from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

QK_K = 256
GROUP = 32  # the int4 parts' group size

SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Types the int4 decomposition covers (Q6_K's 16-value groups do not fit a 32 group).
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K)
# Bits per code, for the start-up log.
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (v uint8 [N,K], scale, zero [N,K/32])


def type_name(qtype: int) -> str:
    return Q(qtype).name


def _blocks(raw: torch.Tensor, qtype: Q, k: int, what: str) -> torch.Tensor:
    """``raw [N, row_bytes]`` uint8 -> ``[N, K / block, type_size]``."""
    block, size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"{what}: {qtype.name} data must be a 2-D uint8 tensor, got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    if k % block or raw.shape[1] != k // block * size:
        raise ValueError(f"{what}: corrupt {qtype.name} tensor: rows of {raw.shape[1]} bytes "
                         f"for {k} values (expected {k // block * size})")
    return raw.reshape(raw.shape[0], k // block, size)


def _f16(b: torch.Tensor, what: str) -> torch.Tensor:
    """Little-endian fp16 from ``[..., 2]`` bytes, as float32; non-finite is corrupt."""
    v = b.contiguous().view(torch.float16).squeeze(-1).float()
    if not torch.isfinite(v).all():
        raise ValueError(f"{what}: corrupt GGUF tensor: non-finite block scale")
    return v


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]`` codes: low nibbles of the n bytes, then high
    (ggml's order within a 32-value run)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> two ``[..., 8]`` uint8."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_quant_fields(blocks: torch.Tensor, what: str, five_bit: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K -> ``(q [N, nb, 8, 32] uint8, s, dm [N, nb, 8, 1] float32)``."""
    d = _f16(blocks[..., 0:2], what).unsqueeze(-1)
    dmin = _f16(blocks[..., 2:4], what).unsqueeze(-1)
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    s = (d * sc.float()).unsqueeze(-1)
    dm = (dmin * mn.float()).unsqueeze(-1)
    if five_bit:
        qh, qs = blocks[..., 16:48], blocks[..., 48:176]
    else:
        qh, qs = None, blocks[..., 16:144]
    n, nb = blocks.shape[:2]
    # qs: 4 runs of 32 bytes; run r holds sub-blocks 2r (low nibbles) and 2r+1 (high).
    ql = qs.reshape(n, nb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(
        1, 1, 1, 2, 1)
    q = (ql & 0x0F).reshape(n, nb, 8, 32)
    if qh is not None:
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
        hb = (qh.reshape(n, nb, 1, 32) >> shifts) & 0x01
        q = q | (hb << 4)
    return q, s, dm


def dequantize(raw: torch.Tensor, qtype: int, k: int, what: str = "tensor") -> torch.Tensor:
    """float32 ``[N, K]``, bitwise equal to ``gguf.quants.dequantize``."""
    qt = Q(qtype)
    b = _blocks(raw, qt, k, what)
    n, nb = b.shape[:2]
    if qt == Q.Q4_0:
        d = _f16(b[..., 0:2], what).unsqueeze(-1)
        q = (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
        return (d * q).reshape(n, k)
    if qt == Q.Q4_1:
        d = _f16(b[..., 0:2], what).unsqueeze(-1)
        m = _f16(b[..., 2:4], what).unsqueeze(-1)
        return (d * _nibbles(b[..., 4:]).float() + m).reshape(n, k)
    if qt == Q.Q8_0:
        d = _f16(b[..., 0:2], what).unsqueeze(-1)
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, k)
    if qt in (Q.Q4_K, Q.Q5_K):
        q, s, dm = _k_quant_fields(b, what, qt == Q.Q5_K)
        return (s * q.float() - dm).reshape(n, k)
    if qt == Q.Q6_K:
        ql, qh = b[..., :128], b[..., 128:192]
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[..., 208:210], what).unsqueeze(-1)
        s = (d * sc).reshape(n, nb, 16, 1)
        lo = ql.reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(
            1, 1, 1, 2, 1)
        lo = (lo & 0x0F).reshape(n, nb, 8, 32)
        hi = qh.reshape(n, nb, 2, 1, 32) >> torch.tensor(
            [0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
        hi = (hi & 0x03).reshape(n, nb, 8, 32)
        q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, nb, 16, 16).float()
        return (s * q).reshape(n, k)
    raise ValueError(f"{what}: GGUF type {qt.name} is not supported; supported: "
                     + ", ".join(t.name for t in SUPPORTED))


def int4_parts(raw: torch.Tensor, qtype: int, k: int, what: str = "tensor") -> list[Part]:
    """The weight as int4 parts (module doc), each ``(v uint8 [N, K] in [0, 15],
    scale float32 [N, K/32], zero float32 [N, K/32])``; ``ValueError`` for a type
    outside ``INT4_TYPES``."""
    qt = Q(qtype)
    b = _blocks(raw, qt, k, what)
    n = b.shape[0]
    g = k // GROUP
    if qt in (Q.Q4_0, Q.Q4_1):
        d = _f16(b[..., 0:2], what)
        v = _nibbles(b[..., 4 if qt == Q.Q4_1 else 2:]).reshape(n, k)
        zero = _f16(b[..., 2:4], what) + 8 * d if qt == Q.Q4_1 else torch.zeros_like(d)
        return [(v, d, zero)]
    if qt == Q.Q8_0:
        d = _f16(b[..., 0:2], what)
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        u = u.reshape(n, k)
        return [(u & 0x0F, d, 8 * d), (u >> 4, 16 * d, torch.zeros_like(d))]
    if qt in (Q.Q4_K, Q.Q5_K):
        q, s, dm = _k_quant_fields(b, what, qt == Q.Q5_K)
        s, dm = s.reshape(n, g), dm.reshape(n, g)
        q = q.reshape(n, k)
        lo = [(q & 0x0F, s, 8 * s - dm)]
        if qt == Q.Q4_K:
            return lo
        return lo + [((q >> 4) + 8, 16 * s, torch.zeros_like(s))]
    raise ValueError(f"{what}: GGUF type {qt.name} has no int4 decomposition")


def q8_0_codes(raw: torch.Tensor, k: int, what: str = "tensor"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor as ``(codes uint8 [N, K] = q + 128, d float32 [N, K/32])``:
    ``value = d * (code - 128)`` (the codes ``code_from_parts`` rebuilds from the two
    int4 parts)."""
    b = _blocks(raw, Q.Q8_0, k, what)
    n = b.shape[0]
    d = _f16(b[..., 0:2], what)
    u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return u.reshape(n, k), d


# The high part's code bias (Q5_K stores hi + 8), per two-part type.
_HI_BIAS = {Q.Q8_0: 0, Q.Q5_K: 8}
# code -> value offset: value = a * (code - off) + b.
_OFFSET = {Q.Q4_0: 8, Q.Q4_1: 0, Q.Q8_0: 128, Q.Q4_K: 0, Q.Q5_K: 0}


def code_from_parts(vs: list[torch.Tensor], qtype: int) -> torch.Tensor:
    """The full code (int16) from the parts' ``v`` of ``int4_parts``."""
    c = vs[0].to(torch.int16)
    if len(vs) > 1:
        c = c + 16 * (vs[1].to(torch.int16) - _HI_BIAS[Q(qtype)])
    return c


def exact_affine(raw: torch.Tensor, qtype: int, k: int, what: str = "tensor"
                 ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(a [N, K/32], b [N, K/32] or None, off)`` with ``value = a * (code - off) + b``
    in float32 bitwise equal to ``dequantize`` (the same operations gguf-py does), for
    the ``INT4_TYPES``; ``code`` from ``code_from_parts``."""
    qt = Q(qtype)
    blk = _blocks(raw, qt, k, what)
    n = blk.shape[0]
    if qt in (Q.Q4_0, Q.Q8_0):
        return _f16(blk[..., 0:2], what), None, _OFFSET[qt]
    if qt == Q.Q4_1:
        return _f16(blk[..., 0:2], what), _f16(blk[..., 2:4], what), 0
    if qt in (Q.Q4_K, Q.Q5_K):
        _, s, dm = _k_quant_fields(blk, what, qt == Q.Q5_K)
        return s.reshape(n, k // GROUP), -dm.reshape(n, k // GROUP), 0
    raise ValueError(f"{what}: GGUF type {qt.name} has no int4 decomposition")
