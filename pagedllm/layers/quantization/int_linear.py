"""Weight-only integer linear layers (W4A16, W8A16): the part every format shares.

A format's method (compressed-tensors ``pack-quantized``, GPTQ, AWQ) registers its
checkpoint tensors and converts them into the canonical layout (``int_layout.IntWeight``)
in ``to_int_weight``; this base class then drops the checkpoint tensors and stores the
weight for the device's kernel, chosen once per layer at load:

```
 CUDA  any weight                   Triton kernels (int_cuda.py: striped layout, by M)
 CPU   4 bits, group 32..256|channel torch int4pack (int4pack.py), one part; bf16 compute
 CPU   8 bits, channel               aten._weight_int8pack_mm (+ a rank-1 zero correction
                                     when asymmetric); activation dtype
 CPU   8 bits, group 32..256         int4pack, two parts (code = 16 * hi + lo); bf16
 CPU   anything else                 dequantised once to the activation dtype; F.linear
```

Act-order (``g_idx``) on the CPU: when every group has exactly ``G`` inputs, the input
features are permuted once at load so that groups are contiguous, and ``apply`` gathers
``x``'s columns in that order (``x[:, perm] @ W[:, perm]^T == x @ W^T``); otherwise the
weight is dequantised once.  CUDA: ``int_cuda.py`` (the same permutation, then the
striped Triton kernels; the canonical kernel reads ``g_idx`` where groups are uneven).

The int4 kernels' affine form is ``(v - 8) * scale + zero``; ours is
``(code - z) * s``, so ``zero = (8 - z) * s`` (exact in real arithmetic; the kernels
round scale and zero to bf16).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.layers.quantization.int4pack import PackedInt4, mm_parts, packable
from pagedllm.layers.quantization.int_layout import IntWeight, act_order_permutation

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

logger = logging.getLogger(__name__)

INT4_GROUPS = (32, 64, 128, 256)  # the groups torch's int4 kernels take


def cpu_kernel_name(bits: int, group_size: int | None, act_order: bool) -> str:
    """What the CPU will run for this scheme (``group_size`` None: channel-wise), for the
    start-up log; a layer whose shape does not fit falls back to ``dense`` (logged)."""
    if bits == 4 and (group_size is None or group_size in INT4_GROUPS):
        kern = "torch int4pack (bf16 activations)"
    elif bits == 8 and group_size is None:
        kern = "torch int8pack"
    elif bits == 8 and group_size in INT4_GROUPS:
        kern = "torch int4pack x2 parts (bf16 activations)"
    else:
        return "dequantised once to the activation dtype (no CPU kernel for this group)"
    return kern + (", act-order inputs permuted at load" if act_order else "")


def _channel_group(k: int) -> int | None:
    """A group of the int4 kernels dividing ``k``: channel scales repeat over it."""
    return next((g for g in (256, 128, 64, 32) if k % g == 0), None)


def _register(layer: nn.Module, name: str, t: torch.Tensor,
              packed_factor: int | None = None) -> torch.Tensor:
    if packed_factor is not None:  # for weight_bytes(as_dtype_bytes=...) in the log
        t.packed_factor = packed_factor  # type: ignore[attr-defined]
    layer.register_buffer(name, t, persistent=False)
    return t


class IntLinearMethod(LinearMethodBase):
    """Base of the weight-only integer methods (module doc).  Subclasses implement
    ``create_weights`` (the checkpoint's tensors) and ``to_int_weight``."""

    cuda_kernel = "Triton wna16"
    #: checkpoint parameter names to delete once converted
    checkpoint_params: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._fallback_logged = False

    @staticmethod
    def init_layer(layer: LinearBase, params_dtype: torch.dtype) -> None:
        """Record the activation dtype (subclasses call it from ``create_weights``)."""
        layer.int_params_dtype = params_dtype  # type: ignore[assignment]

    @abstractmethod
    def to_int_weight(self, layer: LinearBase) -> IntWeight:
        """The loaded checkpoint tensors of ``layer`` in the canonical layout;
        ``ValueError`` naming the tensor if they are inconsistent."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        iw = self.to_int_weight(layer)
        dtype = layer.int_params_dtype  # type: ignore[attr-defined]
        for name in self.checkpoint_params:
            if hasattr(layer, name):
                delattr(layer, name)
        device = iw.qweight.device
        layer.register_buffer("int_perm", None, persistent=False)
        if device.type == "cuda":
            self.store_canonical(layer, iw, dtype)
            return
        kind = self._store_cpu(layer, iw, dtype)
        layer.int_kind = kind  # type: ignore[assignment]
        if kind == "dense" and not self._fallback_logged:
            self._fallback_logged = True
            logger.info("%s: %d-bit weights (group %d%s, %dx%d) have no CPU int kernel; "
                        "dequantised once to %s", layer.prefix, iw.bits, iw.group_size,
                        ", act-order" if iw.g_idx is not None else "", iw.n, iw.k,
                        str(dtype).replace("torch.", ""))

    def dummy_init(self, layer: LinearBase, generator: torch.Generator, init: str) -> bool:
        """Random codes (every int tensor: packed words, zero points), one small scale,
        ``g_idx = k // G``: the checkpoint's layout with dummy values (benchmarks)."""
        amp = 1e-3 if init == "uniform" else 0.05
        k = layer.in_per_partition  # type: ignore[attr-defined]
        group = getattr(self, "group_size", None) or k
        for name, p in layer.named_parameters(recurse=False):
            if name.endswith("g_idx"):
                p.data.copy_(torch.arange(p.numel(), device=p.device) // group)
            elif name == "weight_shape":
                continue
            elif p.dtype in (torch.int32, torch.int8):
                info = torch.iinfo(p.dtype)
                p.data.copy_(torch.randint(info.min, info.max, tuple(p.shape),
                                           generator=generator, device=p.device,
                                           dtype=torch.int64).to(p.dtype))
            elif name == "bias":
                p.data.zero_()
            elif p.is_floating_point():
                p.data.fill_(amp / 8.0)
        return True

    # -- storage -------------------------------------------------------------------

    def store_canonical(self, layer: LinearBase, iw: IntWeight, dtype: torch.dtype) -> None:
        """The CUDA storage (``int_cuda.store_cuda``: the striped or canonical layout for
        the Triton kernels; the kernel tests also call it on CPU tensors under
        ``TRITON_INTERPRET=1``)."""
        from pagedllm.layers.quantization.int_cuda import store_cuda

        layer.int_kind = "wna16"  # type: ignore[assignment]
        store_cuda(layer, iw, dtype)

    def _store_cpu(self, layer: LinearBase, iw: IntWeight, dtype: torch.dtype) -> str:
        codes, group, n, k = iw.codes(), iw.group_size, iw.n, iw.k
        scales, zeros = iw.scales.float(), iw.zero_codes()
        if iw.g_idx is not None:
            perm = act_order_permutation(iw.g_idx, group, int(scales.shape[1]))
            if perm is None:
                return self._store_dense(layer, iw, dtype)
            codes = codes[:, perm]  # groups now contiguous: input j is in group j // G
            layer.int_perm = perm  # type: ignore[assignment]
        if iw.bits == 8 and group == k:
            # w = (c - z) s = (c - 128) s + (128 - z) s: int8 kernel + rank-1 term.
            w_q = (codes - 128).to(torch.int8).contiguous()
            s = iw.scales.reshape(n).to(dtype)
            _register(layer, "int8_weight", w_q)
            _register(layer, "int8_scales", s.contiguous())
            layer.int8_zero_corr = None if iw.zeros is None else _register(  # type: ignore
                layer, "int8_zero_corr",
                (128.0 - iw.zeros.float().reshape(n)) * iw.scales.float().reshape(n))
            return "int8pack"
        if group == k and group not in INT4_GROUPS:  # channel: repeat over a kernel group
            sub = _channel_group(k)
            if sub is not None:
                scales = scales.repeat_interleave(k // sub, 1)
                zeros = zeros.repeat_interleave(k // sub, 1)
                group = sub
        if group not in INT4_GROUPS or not packable(n, k, codes.device):
            return self._store_dense(layer, iw, dtype)
        if iw.bits == 4:
            parts = [PackedInt4(codes, scales, (8.0 - zeros) * scales, group, codes.device)]
        else:  # 8 bits as two nibbles: (16 hi + lo - z) s = (hi - 8) 16 s + (136 - z) s
            # + (lo - 8) s + 0; the whole zero term sits in one part, so its bf16
            # rounding is one rounding (split across parts, two would not cancel).
            parts = [PackedInt4(codes >> 4, 16.0 * scales, (136.0 - zeros) * scales, group,
                                codes.device),
                     PackedInt4(codes & 0xF, scales, torch.zeros_like(scales), group,
                                codes.device)]
        for j, p in enumerate(parts):
            _register(layer, f"int4_p{j}_packed", p.packed, 2)
            _register(layer, f"int4_p{j}_scale_zero", p.scale_zero)
        layer.int4_parts = parts  # type: ignore[assignment]
        return "int4pack"

    def int4_segments(self, layer: LinearBase) -> list[list[Any]] | None:
        if getattr(layer, "int_kind", None) != "int4pack" or layer.int_perm is not None:
            return None
        return [layer.int4_parts]  # type: ignore[attr-defined]

    def _store_dense(self, layer: LinearBase, iw: IntWeight, dtype: torch.dtype) -> str:
        layer.int_perm = None  # type: ignore[assignment]  (the weight is not permuted)
        _register(layer, "int_dense_weight", iw.dequantize(dtype).contiguous())
        return "dense"

    # -- compute -------------------------------------------------------------------

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        kind = layer.int_kind  # type: ignore[attr-defined]
        if kind == "dense":
            return F.linear(x, layer.int_dense_weight, bias)  # type: ignore[arg-type]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if kind == "wna16":
            from pagedllm.layers.quantization.int_cuda import apply_cuda

            y = apply_cuda(layer, x2)
        else:
            perm = layer.int_perm  # type: ignore[attr-defined]
            if perm is not None:
                x2 = x2.index_select(1, perm)
            if kind == "int8pack":
                xs = x2.to(layer.int8_scales.dtype)  # type: ignore[union-attr]
                y = torch.ops.aten._weight_int8pack_mm(
                    xs, layer.int8_weight, layer.int8_scales)
                corr = layer.int8_zero_corr  # type: ignore[attr-defined]
                if corr is not None:  # in fp32: a bf16 row sum would lose the term
                    y = y.float() + x2.float().sum(-1, keepdim=True) * corr
                y = y.to(x.dtype)
            else:
                y = mm_parts(x2, layer.int4_parts)  # type: ignore[arg-type]
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])
