"""The one in-memory layout of every weight-only integer format (W4A16, W8A16), and the
bit-level helpers that convert checkpoints into it.

```
 qweight  int32 [N, K * bits / 32]   unsigned codes packed along K, little-endian in the
                                     word: code of input k at bits (k % P) * bits of word
                                     k // P, P = 32 / bits (8 codes a word at 4 bits)
 scales   [N, K / G]                 activation dtype (G = K: one scale per channel)
 zeros    [N, K / G] float | None    in code units; None = symmetric, zero = 2**(bits-1)
 g_idx    int32 [K] | None           act-order: the group of input k (None: k // G)

 w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)]
```

compressed-tensors ``pack-quantized``, GPTQ and AWQ are all converted to it once, in
their method's ``process_weights_after_loading``; from there ``int_linear.py`` picks the
kernel (Triton ``kernels/wna16.py`` on CUDA, torch's packed int4/int8 kernels on the CPU).
The same layout and the same ``(x, qweight, scales, zeros, g_idx, bits, group_size)``
arguments are the GPU kernels' contract.

Every function here is vectorised torch (no loop over blocks) and runs once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class IntWeight:
    """One layer's weight in the canonical layout (module doc); ``group_size`` is the
    resolved group (``K`` for channel-wise scales)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def n(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def k(self) -> int:
        return int(self.qweight.shape[1]) * 32 // self.bits

    def codes(self) -> torch.Tensor:
        """Unsigned codes ``int32 [N, K]``."""
        return unpack_codes(self.qweight, self.bits)

    def groups(self) -> torch.Tensor:
        """The group of each input ``k``: ``int64 [K]``."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.k, device=self.qweight.device) // self.group_size

    def zero_codes(self) -> torch.Tensor:
        """``[N, K / G]`` float32 zeros (the symmetric midpoint when ``zeros`` is None)."""
        if self.zeros is not None:
            return self.zeros.float()
        return torch.full(tuple(self.scales.shape), float(1 << (self.bits - 1)),
                          device=self.scales.device)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``w [N, K]``: ``(code - zero) * scale`` computed in the scales' dtype (as the
        compressed-tensors library computes it), cast to ``dtype`` if given."""
        g = self.groups()
        sdt = self.scales.dtype
        w = (self.codes().to(sdt) - self.zero_codes().to(sdt)[:, g]) * self.scales[:, g]
        return w if dtype is None else w.to(dtype)


def check_bits(bits: int, what: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: {bits}-bit weights are not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_BITS))} bits")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``codes [N, K]`` -> canonical ``int32 [N, K * bits / 32]``."""
    return pack_int32(codes, bits, dim=1)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Canonical ``int32 [N, K * bits / 32]`` -> unsigned codes ``int32 [N, K]``."""
    return unpack_int32(qweight, bits, dim=1)


def pack_int32(values: torch.Tensor, bits: int, dim: int,
               order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned ``values`` (2-D, in ``[0, 2**bits)``) into int32 words along
    ``dim``, little-endian: slot ``j`` of word ``w`` (bits ``j * bits``) holds element
    ``w * P + order[j]`` (``order`` defaults to ``0, 1, ..., P - 1``)."""
    p = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    if cols % p:
        raise ValueError(f"{cols} values do not fill whole int32 words of {p}")
    v = v.reshape(rows, cols // p, p)
    if order is not None:
        v = v[..., order]
    shifts = torch.arange(p, device=v.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # disjoint bit fields: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: list[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: unsigned ``int32`` values, ``P`` times longer
    along ``dim``."""
    p = 32 // bits
    w = packed.t() if dim == 0 else packed
    shifts = torch.arange(p, device=w.device, dtype=torch.int32) * bits
    # An arithmetic shift of a negative word fills with ones; the mask drops them.
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        # slot j holds element order[j]: element e sits in slot inverse[e]
        inverse = [order.index(e) for e in range(p)]
        v = v[..., inverse]
    v = v.reshape(w.shape[0], -1)
    return (v.t() if dim == 0 else v).contiguous()


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` is just ``k // group_size`` (no act-order): then it is dropped."""
    k = g_idx.numel()
    ref = torch.arange(k, device=g_idx.device) // group_size
    return bool(torch.equal(g_idx.long(), ref))


def act_order_permutation(g_idx: torch.Tensor, group_size: int,
                          num_groups: int) -> torch.Tensor | None:
    """The input permutation that makes act-order groups contiguous: ``perm`` with
    ``g_idx[perm][j] == j // group_size``, or None when the groups are not all exactly
    ``group_size`` long (then no contiguous-group kernel can run it)."""
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    if counts.numel() != num_groups or not bool((counts == group_size).all()):
        return None
    return torch.argsort(g_idx.long(), stable=True)
