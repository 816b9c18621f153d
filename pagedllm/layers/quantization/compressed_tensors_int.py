"""compressed-tensors integer schemes (what llmcompressor writes for W4A16, W8A16 and
W8A8-INT8), chosen by ``compressed_tensors.CompressedTensorsConfig`` for a config group
whose weights are ``type: "int"``.

```
 pack-quantized (weight-only, 4 or 8 bits)
   weight_packed      int32 [N, K*bits/32]   codes + 2**(bits-1) (unsigned), packed along K
                                             little-endian: already the canonical layout
   weight_scale       [N, K/G] (group) | [N, 1] (channel)
   weight_zero_point  int32 [N*bits/32, K/G] asymmetric only: signed zeros + 2**(bits-1),
                                             packed along N (dim 0) the same way
   weight_g_idx       int32 [K]              actorder "group" only
   weight_shape       int64 [2]              (N, K), checked
 int-quantized / naive-quantized
   weight             int8 [N, K]            signed codes
   weight_scale       [N, 1]
 w[n, k] = (q - zp) * scale      (q, zp signed; in unsigned codes (code - zero) * scale)
```

The library computes ``(q - zp) * scale`` in the scale's dtype; the canonical zeros are
``zp + 2**(bits-1)`` and scales are loaded as float32, so our dequantised weight is the
library's exactly (the integer difference and its product with the scale are exact in
float32, then rounded once).

Supported: weight-only int 4/8 bits, group (any group dividing K) or channel strategy,
symmetric or asymmetric, optional group act-order; W8A8 int8 with channel weights and
dynamic per-token symmetric activations (``int8_w8a8.py``).  Anything else is a
one-line ``ValueError`` naming the scheme.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, set_weight_attrs
from pagedllm.layers.quantization.int_layout import (
    IntWeight,
    trivial_g_idx,
    unpack_int32,
)
from pagedllm.layers.quantization.int_linear import IntLinearMethod, cpu_kernel_name

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

INT_SCHEMES = ("int weight-only (pack-quantized W4A16 / W8A16: 4 or 8 bits, group or "
               "channel, symmetric or asymmetric), W8A8-INT8 (int-quantized: channel "
               "weights, dynamic per-token activations)")


def _as_dict(x: Any) -> dict[str, Any]:
    if x is None:
        return {}
    if isinstance(x, dict):
        return x
    return x.to_dict() if hasattr(x, "to_dict") else dict(vars(x))


def scheme_label(group: dict[str, Any]) -> str:
    w, a = _as_dict(group.get("weights")), _as_dict(group.get("input_activations"))
    sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
    label = f"int{w.get('num_bits')} weights/{w.get('strategy')}"
    if w.get("strategy") == "group":
        label += f" {w.get('group_size')}"
    label += f" {sym}"
    if w.get("actorder"):
        label += f" actorder={w.get('actorder')}"
    if a:
        label += (f", activations {a.get('type')}{a.get('num_bits')}/{a.get('strategy')}"
                  f"{' dynamic' if a.get('dynamic') else ' static'}"
                  f"{'' if a.get('symmetric', True) else ' asymmetric'}")
    return f"{label} ({group.get('format')})"


def _unsupported(group: dict[str, Any], why: str) -> ValueError:
    return ValueError(f"compressed-tensors scheme {scheme_label(group)} is not supported "
                      f"({why}); supported: {INT_SCHEMES}")


def make_int_method(group: dict[str, Any]) -> LinearMethodBase:
    """The linear method of a config group with integer weights (module doc)."""
    w = _as_dict(group.get("weights"))
    act = _as_dict(group.get("input_activations"))
    fmt = str(group.get("format") or "")
    bits = int(w.get("num_bits") or 0)
    strategy = w.get("strategy")
    if act:
        if act.get("type") != "int" or int(act.get("num_bits") or 0) != 8:
            raise _unsupported(group, "activations must be int8")
        if act.get("strategy") != "token" or not act.get("dynamic") \
                or not act.get("symmetric", True):
            raise _unsupported(group, "int8 activations must be dynamic, per token, "
                                      "symmetric")
        if bits != 8 or strategy != "channel" or not w.get("symmetric", True):
            raise _unsupported(group, "W8A8 needs int8 symmetric per-channel weights")
        if fmt not in ("int-quantized", "naive-quantized"):
            raise _unsupported(group, f"format {fmt!r}")
        from pagedllm.layers.quantization.int8_w8a8 import Int8W8A8LinearMethod

        return Int8W8A8LinearMethod()
    if bits not in (4, 8):
        raise _unsupported(group, f"{bits}-bit weights")
    if strategy not in ("group", "channel"):
        raise _unsupported(group, f"strategy {strategy!r}")
    if w.get("dynamic"):
        raise _unsupported(group, "dynamic weight scales")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise _unsupported(group, f"actorder {actorder!r}")
    group_size = int(w.get("group_size") or 0) if strategy == "group" else None
    if strategy == "group" and group_size <= 0:
        raise _unsupported(group, "group strategy without a group_size")
    if fmt == "pack-quantized":
        return CTPackedLinearMethod(bits, group_size, bool(w.get("symmetric", True)),
                                    actorder == "group")
    if fmt in ("int-quantized", "naive-quantized") and bits == 8:
        return CTPackedLinearMethod(8, group_size, bool(w.get("symmetric", True)),
                                    actorder == "group", packed=False)
    raise _unsupported(group, f"format {fmt!r}")


class CTPackedLinearMethod(IntLinearMethod):
    """Weight-only int weights of a compressed-tensors checkpoint (module doc):
    ``packed`` for ``pack-quantized`` (int32 words), False for an int8 ``weight``."""

    checkpoint_params = ("weight_packed", "weight", "weight_scale", "weight_zero_point",
                         "weight_g_idx", "weight_shape")

    def __init__(self, bits: int, group_size: int | None, symmetric: bool,
                 act_order: bool, packed: bool = True) -> None:
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.symmetric, self.act_order, self.packed = symmetric, act_order, packed

    def describe(self) -> str:
        gs = f"group {self.group_size}" if self.group_size else "channel"
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"int{self.bits} {gs} {sym}{', act-order' if self.act_order else ''}"

    def cpu_kernel(self) -> str:
        return cpu_kernel_name(self.bits, self.group_size, self.act_order)

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        self.init_layer(layer, params_dtype)
        n, k, p = sum(output_partition_sizes), input_size_per_partition, 32 // self.bits
        g = self.group_size or k
        if k % g or (self.packed and k % p):
            raise ValueError(f"{layer.prefix}: input size {k} is not a multiple of the "
                             f"group size {g} and of {p} codes per int32 word")
        grouped = self.group_size is not None
        if self.packed:
            qw = nn.Parameter(torch.empty(n, k // p, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(qw, {"output_dim": 0, "input_dim": 1, "packed_dim": 1,
                                  "packed_factor": p})
            layer.register_parameter("weight_packed", qw)
        else:
            qw = nn.Parameter(torch.empty(n, k, dtype=torch.int8), requires_grad=False)
            set_weight_attrs(qw, {"output_dim": 0, "input_dim": 1})
            layer.register_parameter("weight", qw)
        # float32 whatever the checkpoint's dtype: exact, and the library's arithmetic.
        scale = nn.Parameter(torch.empty(n, k // g, dtype=torch.float32),
                             requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "input_dim": 1 if grouped else None})
        layer.register_parameter("weight_scale", scale)
        if not self.symmetric:
            if n % p and self.packed:
                raise ValueError(f"{layer.prefix}: {n} output rows do not pack into "
                                 f"int32 zero points of {p}")
            zp = nn.Parameter(torch.empty(n // p if self.packed else n, k // g,
                                          dtype=torch.int32 if self.packed else torch.int8),
                              requires_grad=False)
            attrs: dict[str, Any] = {"output_dim": 0, "input_dim": 1 if grouped else None}
            if self.packed:
                attrs.update(packed_dim=0, packed_factor=p)
            set_weight_attrs(zp, attrs)
            layer.register_parameter("weight_zero_point", zp)
        if self.act_order:
            gi = nn.Parameter(torch.empty(k, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(gi, {"input_dim": 0})
            layer.register_parameter("weight_g_idx", gi)
        if self.packed:
            shape = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
            set_weight_attrs(shape, {"weight_loader": functools.partial(_check_shape, layer)})
            layer.register_parameter("weight_shape", shape)

    def to_int_weight(self, layer: LinearBase) -> IntWeight:
        p, half = 32 // self.bits, 1 << (self.bits - 1)
        if self.packed:
            qweight = layer.weight_packed.data  # type: ignore[union-attr]
        else:  # signed int8 -> unsigned codes, packed
            from pagedllm.layers.quantization.int_layout import pack_codes

            qweight = pack_codes(layer.weight.data.to(torch.int32) + half, 8)
        k = qweight.shape[1] * p
        zeros = None
        if not self.symmetric:
            zp = layer.weight_zero_point.data  # type: ignore[union-attr]
            z = unpack_int32(zp, self.bits, dim=0) if self.packed else zp.to(torch.int32) + half
            zeros = z.float()
        g_idx = None
        group = self.group_size or k
        if self.act_order:
            g_idx = layer.weight_g_idx.data.to(torch.int32)  # type: ignore[union-attr]
            if trivial_g_idx(g_idx, group):
                g_idx = None
            elif int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group:
                raise ValueError(f"{layer.prefix}.weight_g_idx: group indices outside "
                                 f"[0, {k // group})")
        return IntWeight(qweight, layer.weight_scale.data, zeros, g_idx,  # type: ignore
                         self.bits, group)


def _check_shape(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | str | None = None) -> None:
    """``weight_shape`` must be this shard's full (unsharded) ``[out, in]``."""
    if shard_id is None:
        out = layer.output_size
    else:
        out = layer._shard_range(shard_id)[3]  # type: ignore[attr-defined]
    got = [int(v) for v in loaded.reshape(-1).tolist()]
    if got != [out, layer.input_size]:
        raise ValueError(f"weight_shape {got} does not match the layer's "
                         f"[{out}, {layer.input_size}]")
    param.data.copy_(loaded.reshape(2))
