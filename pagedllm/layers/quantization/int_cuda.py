"""The CUDA storage and kernel choice of the weight-only integer layers (W4A16, W8A16).

``IntLinearMethod`` hands every CUDA layer's canonical weight (``int_layout.IntWeight``)
to :func:`store_cuda` at load and every call to :func:`apply_cuda`.  What is stored
depends on whether the weight has zero points (AWQ, asymmetric GPTQ and
compressed-tensors) or is symmetric, and on whether this GPU has a tuned K-major GEMV
table (``wna16_kmajor.has_table``: shipped for the H100 and the H200):

```
 act-order (g_idx) with equal groups   inputs permuted at load (groups contiguous);
                                       apply gathers x[:, perm] once per call
 "kmajor": 4-bit, K % 128 == 0,        only the K-major layout (int_layout "kmajor"):
   group % 128 == 0 | K                int32 [K/8, N] words, scales [K/G, N], zeros
   (wna16_tc.tc_applies), and          [K/G, N] in the scales' dtype (integer codes:
   zero points or a K-major table      exact; fp32 if a zero is not) or None
                                       (symmetric: the kernels' constant 8); a
                                       group-128 layer is ~1.02x its checkpoint
 symmetric without a K-major table ("stripe+tc"):
 K % 128 == 0, group % 128 == 0 | K    the striped layout (kernels/wna16_stripe.py)
   and 4-bit, tc_min_m > 0             also the K-major layout (kernels/wna16_tc.py):
   (16 with a tuned table, else 0)     int32 [K/8, N] words, scales [K/G, N], zeros
                                       (8 for symmetric weights)
 other striped layers                  the striped layout alone
 anything else                         the canonical layout (kernels/wna16.py)
 tinygemm_max_m > 0                    also torch's int4 layout (4-bit, groups 32..256)
```

Why (H100, `bench latency --num-prompts 2`, Llama-3-8B shape, no tuned tensor-core table
on that GPU): with zero points the K-major layout ran W4 at TPOT 4.27 ms against the
striped layout's 8.61 (2026-12-05; its zero-point GEMV is 2-3x faster per layer,
``benchmarks/int4_layer_bench.py``).  Symmetric, the K-major GEMV wins only tuned
(2026-12-06, one lease, the shipped table of every projection): 3.04 ms against the
striped layout's 3.33, and W1 6,636 against 5,935 output tok/s; with its priors it
loses by about the table's gain (the sweep's per-step sums: 3.05 ms of GEMV against
2.42 tuned), so a GPU without a K-major table keeps "stripe+tc".  On the H200 with its
table (2026-12-06): symmetric K-major 2.83 ms against striped 2.81, W1 7,342 against 7,249,
in half the weight memory of "stripe+tc".  Where "stripe+tc" stays and a tuned
tensor-core table exists, the symmetric layers' K-major copy costs another half byte
per weight (the striped copy stays for the decode GEMV below ``TC_MIN_M`` rows and for
the dequantise path); a "kmajor" layer's K-major copy is the weight (``packed_factor``
8: the start-up log counts it as such) and it keeps no ``int_qweight``.

Which kernel runs depends only on the row count ``M`` (host int): CUDA graphs and eager
runs of one batch size agree, and nothing syncs.  The thresholds are the tuned table's
(``summary`` of ``kernels/tuned/wna16_<GPU>.json`` / ``wna16_tc_<GPU>.json``, written by
the sweeps in ``benchmarks/``), else the defaults below.  ``stripe+tc`` (and every
striped layer):

```
 M <= tinygemm_max_m (default 0: off)                 torch _weight_int4pack_mm
 M >= tc_min_m (K-major copy stored)                   the tensor-core W4A16 GEMM, or
                                                       dequantise + cuBLAS where the tuned
                                                       table (kernels/wna16_tc_config.py)
                                                       measured that faster; only GPU-
                                                       checked table entries: without an
                                                       entry (or a table: TC_MIN_M is 0
                                                       then) the rows below
 M <  dequant_min_m  (default 512)                    wna16_stripe GEMV (M <= 4) / tile
 M >= dequant_min_m                                    dequantise the whole layer into
                                                       one shared bf16 scratch + cuBLAS
                                                       F.linear
```

``kmajor`` layers (:func:`_kmajor_route`):

```
 M <= tinygemm_max_m (default 0: off)                 torch _weight_int4pack_mm
 M <= KMAJOR_GEMV_MAX_M (4)                           wna16_kmajor.kmajor_gemv (priors)
 M >= tc_min_m, a table entry for (N, K)               as above: its tensor-core
                                                       configuration, or its "dequant"
                                                       (wna16_kmajor.kmajor_dequantize
                                                       of the whole layer into the
                                                       scratch + F.linear)
 otherwise, M >= dequant_min_m                         kmajor_dequantize + F.linear
 otherwise (5..15 rows; shapes the table lacks)       the tensor-core GEMM with
                                                       wna16_tc_config.tc_config: the
                                                       table's next entry (16 rows: the
                                                       kernel masks the rows past M), else
                                                       the priors -- not GPU-checked as
                                                       the table's are: there is no other
                                                       kernel on this layout
```

The dequantise path writes and re-reads the weight in bf16 (about 2.5x a bf16 layer's
weight traffic), so it pays only where the GEMM is compute-bound (large M: prefill); its
scratch is one buffer per (device, dtype) the size of the largest such layer (Llama-3-8B
gate_up: 28672 x 4096 bf16, 235 MB), allocated at load so the KV-cache planner counts it
as weights.  Layers run one after another on one stream, so they share it (also inside a
CUDA graph).  A table's ``dequant_min_m`` of 0 turns it off (the Triton tile for every
M).  Dequantising in L2-sized chunks (one GEMM a chunk) was measured slower and removed
(H100, 2026-12-07: 16.0 / 24.2 ms in 16 / 8 MB chunks against 13.3 whole, a 256-row step
of 32 Llama-3-8B layers).
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization.int4pack import PackedInt4, mm_parts, packable
from pagedllm.layers.quantization.int_layout import IntWeight, act_order_permutation

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

_TINYGEMM_GROUPS = (32, 64, 128, 256)
KMAJOR_GEMV_MAX_M = 4  # kmajor layers: rows the K-major GEMV takes (it can take 8)


class _Scratch:
    """One ``(device, dtype)``'s dequantisation scratch, shared by every layer that uses
    it.  The layers hold it (``layer.int_scratch``); ``_SCRATCH`` only finds it, so the
    buffer is freed with the last engine's layers -- no module global keeps device memory
    past an engine's shutdown."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


_SCRATCH: weakref.WeakValueDictionary[tuple[torch.device, torch.dtype], _Scratch] = \
    weakref.WeakValueDictionary()


def _threshold(name: str, default: int) -> int:
    """The tuned file's recommendation (``kernels/wna16_stripe.tuned_threshold``), else
    ``default``."""
    from pagedllm.kernels.wna16_stripe import tuned_threshold

    tuned = tuned_threshold(name)
    return default if tuned is None else tuned


def dequant_min_m() -> int:
    """Rows from which the dequantise + cuBLAS path runs (0: never)."""
    return _threshold("dequant_min_m", 512)


def tinygemm_max_m() -> int:
    """Rows up to which torch's int4 kernel runs (0: never)."""
    return _threshold("tinygemm_max_m", 0)


def dequant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, bits: int, group_size: int,
                   scratch: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` by dequantising the whole striped weight into ``scratch``
    (flat, at least ``N * K`` elements of ``x.dtype``) and one cuBLAS GEMM."""
    from pagedllm.kernels.wna16_stripe import stripe_dequantize

    n, k = qweight.shape[0], x.shape[1]
    w = stripe_dequantize(qweight, scales, zeros, bits, group_size,
                          scratch[:n * k].view(n, k))
    return F.linear(x, w)


def kmajor_dequant_linear(x: torch.Tensor, qweight_t: torch.Tensor,
                          scales_t: torch.Tensor, zeros_t: torch.Tensor | None,
                          group_size: int, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`dequant_linear` for the K-major 4-bit layout (``wna16_kmajor``)."""
    from pagedllm.kernels.wna16_kmajor import kmajor_dequantize

    n, k = qweight_t.shape[1], x.shape[1]
    w = kmajor_dequantize(qweight_t, scales_t, zeros_t, group_size,
                          scratch[:n * k].view(n, k))
    return F.linear(x, w)


def reserve_scratch(numel: int, device: torch.device, dtype: torch.dtype) -> _Scratch:
    """The shared dequantisation scratch of ``(device, dtype)``, grown to ``numel``; the
    caller keeps it alive (``_Scratch``)."""
    key = (torch.device(device), dtype)
    cur = _SCRATCH.get(key)
    if cur is None:
        cur = _SCRATCH[key] = _Scratch(torch.empty(numel, dtype=dtype, device=device))
    elif cur.tensor.numel() < numel:
        cur.tensor = torch.empty(numel, dtype=dtype, device=device)
    return cur


def _scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _SCRATCH[(torch.device(device), dtype)].tensor


def _register(layer: torch.nn.Module, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        setattr(layer, name, None)
    else:
        # A fresh row-major copy: contiguous() keeps a [N, 1] transposed view's stride
        # (1, N), and the kernels check stride(1) == 1.
        rows = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        layer.register_buffer(name, rows, persistent=False)


def store_cuda(layer: LinearBase, iw: IntWeight, dtype: torch.dtype) -> None:
    """Store ``iw`` for the CUDA kernels (module doc); sets ``layer.int_layout``."""
    from pagedllm.kernels.wna16_kmajor import has_table as kmajor_has_table
    from pagedllm.kernels.wna16_tc import tc_applies

    perm = None
    qweight, g_idx = iw.qweight, iw.g_idx
    if g_idx is not None:
        perm = act_order_permutation(g_idx, iw.group_size, int(iw.scales.shape[1]))
        if perm is not None:  # groups contiguous after the permutation: g(j) = j // G
            from pagedllm.kernels.wna16 import pack_codes

            qweight = pack_codes(iw.codes()[:, perm], iw.bits)
            g_idx = None
    layer.int_perm = perm  # type: ignore[assignment]
    if (tc_applies(iw.bits, iw.k, iw.group_size, g_idx is not None)
            and (iw.zeros is not None or kmajor_has_table())):
        _store_kmajor(layer, iw, qweight, dtype)
    else:
        _store_striped(layer, iw, qweight, g_idx, dtype)
    layer.int_tinygemm = None  # type: ignore[assignment]
    if (tinygemm_max_m() > 0 and iw.bits == 4 and iw.qweight.is_cuda and g_idx is None
            and iw.group_size in _TINYGEMM_GROUPS and packable(iw.n, iw.k, iw.qweight.device)):
        codes = iw.codes() if perm is None else iw.codes()[:, perm]
        s = iw.scales.float()
        layer.int_tinygemm = PackedInt4(codes, s, (8.0 - iw.zero_codes()) * s,  # type: ignore
                                        iw.group_size, iw.qweight.device)


def layout_summary(modules: Iterable[torch.nn.Module]) -> str | None:
    """What :func:`store_cuda` decided, for the start-up log: ``"int layouts: kmajor x224"``
    (``stripe+tc`` for a striped layer that also keeps the K-major copy); None without
    such layers."""
    counts: Counter[str] = Counter()
    for m in modules:
        layout = getattr(m, "int_layout", None)
        if layout == "stripe" and getattr(m, "int_tc_qweight", None) is not None:
            layout = "stripe+tc"
        if layout is not None:
            counts[layout] += 1
    if not counts:
        return None
    return "int layouts: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _store_striped(layer: LinearBase, iw: IntWeight, qweight: torch.Tensor,
                   g_idx: torch.Tensor | None, dtype: torch.dtype) -> None:
    """The ``stripe+tc`` storage (symmetric weights on a GPU without a K-major GEMV
    table, and layers ``kmajor`` does not take):
    the striped layout where it applies (with the K-major copy where the tensor-core
    kernel does), else the canonical one.  ``qweight`` and ``g_idx``: after any act-order
    permutation."""
    from pagedllm.kernels.wna16_stripe import stripe_applies, to_stripes

    stripe = stripe_applies(iw.bits, iw.k, iw.group_size, g_idx is not None)
    layer.int_layout = "stripe" if stripe else "canonical"  # type: ignore[assignment]
    _register(layer, "int_qweight", to_stripes(qweight, iw.bits) if stripe else qweight)
    qw = layer.int_qweight
    qw.packed_factor = 32 // iw.bits  # type: ignore[attr-defined]  (weight_bytes log)
    _register(layer, "int_scales", iw.scales.to(dtype))
    _register(layer, "int_zeros", None if iw.zeros is None else iw.zeros.float())
    _register(layer, "int_g_idx", None if g_idx is None else g_idx.to(torch.int32))
    layer.int_bits, layer.int_group = iw.bits, iw.group_size  # type: ignore[assignment]
    if stripe and dequant_min_m() > 0 and qw.is_cuda:
        layer.int_scratch = reserve_scratch(  # type: ignore[assignment]
            iw.n * iw.k, qw.device, dtype)
    _store_tc(layer, iw, qweight, stripe, g_idx is not None, dtype)


def _store_kmajor(layer: LinearBase, iw: IntWeight, qweight: torch.Tensor,
                  dtype: torch.dtype) -> None:
    """The ``kmajor`` storage (module doc): the K-major layout alone, in the tensor-core
    kernel's tensors (``int_tc_*``); ``qweight`` is the canonical weight after any
    act-order permutation.  The dequantise scratch is reserved as for the striped layout
    (also on CPU tensors under ``TRITON_INTERPRET=1``, so the tests reach that route)."""
    from pagedllm.kernels.wna16_tc import to_kmajor

    layer.int_layout = "kmajor"  # type: ignore[assignment]
    layer.int_bits, layer.int_group = iw.bits, iw.group_size  # type: ignore[assignment]
    for name in ("int_qweight", "int_scales", "int_zeros", "int_g_idx"):
        setattr(layer, name, None)  # no striped or canonical copy
    _register(layer, "int_tc_qweight", to_kmajor(qweight))
    # the weight itself (not a second copy, as in stripe+tc): weight_bytes counts it
    layer.int_tc_qweight.packed_factor = 32 // iw.bits  # type: ignore[union-attr]
    _register(layer, "int_tc_scales", iw.scales.to(dtype).t())
    # Zero points (symmetric weights have none: the kernels' constant 8) in the scales' dtype
    # (2 bytes, not fp32's 4: 1.02x a group-128 checkpoint, not 1.05x); the checkpoints'
    # integer codes are exact in bf16/fp16 and the kernels read them as fp32, so the
    # results are those of fp32 zeros bit for bit.  A zero the dtype would round (no
    # checkpoint format makes one) keeps fp32.
    _register(layer, "int_tc_zeros", _kmajor_zeros(iw, dtype))
    layer.int_scratch = None  # type: ignore[assignment]
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if dequant_min_m() > 0 and (qweight.is_cuda or interpret):
        layer.int_scratch = reserve_scratch(  # type: ignore[assignment]
            iw.n * iw.k, qweight.device, dtype)


def _kmajor_zeros(iw: IntWeight, dtype: torch.dtype) -> torch.Tensor | None:
    """``kmajor``'s ``[K/G, N]`` zero points: in ``dtype`` (the scales') when every zero
    is exact there, else fp32 (one check at load); None for symmetric weights (the
    kernels' constant 8)."""
    if iw.zeros is None:
        return None
    z = iw.zeros.float().t()
    low = z.to(dtype)
    return low if torch.equal(low.float(), z) else z


def _store_tc(layer: LinearBase, iw: IntWeight, qweight: torch.Tensor, stripe: bool,
              has_g_idx: bool, dtype: torch.dtype) -> None:
    """The K-major copy of a 4-bit striped layer for the tensor-core GEMM (module doc):
    ``int_tc_qweight [K/8, N]``, ``int_tc_scales [K/G, N]``, ``int_tc_zeros`` (or None
    each, when the kernel does not apply or ``tc_min_m`` is 0).  ``qweight``
    is the canonical weight after any act-order permutation."""
    from pagedllm.kernels.wna16_tc import tc_applies, to_kmajor
    from pagedllm.kernels.wna16_tc_config import tc_min_m

    use = stripe and tc_min_m() > 0 and tc_applies(iw.bits, iw.k, iw.group_size, has_g_idx)
    _register(layer, "int_tc_qweight", to_kmajor(qweight) if use else None)
    if use:  # a second copy of the weight: stored bytes, not part of the unquantised size
        layer.int_tc_qweight.packed_factor = 0  # type: ignore[union-attr]  (weight_bytes)
    _register(layer, "int_tc_scales", iw.scales.to(dtype).t() if use else None)
    # Symmetric weights get an explicit zero point of 8: one kernel path (HAS_ZERO) for
    # every weight, the one the sweep checks and times on the GPU.  In the scales' dtype
    # where exact (``_kmajor_zeros``), so the packed-half unpack applies.
    zeros = None
    if use:
        zeros = (_kmajor_zeros(iw, dtype) if iw.zeros is not None else
                 torch.full((iw.scales.shape[1], iw.scales.shape[0]), 8.0, dtype=dtype,
                            device=qweight.device))
    _register(layer, "int_tc_zeros", zeros)


def _tc_route(layer: LinearBase, m: int, n: int, k: int, device: torch.device,
              can_dequant: bool | None = None
              ) -> tuple[str, tuple[int, ...] | None] | None:
    """From ``TC_MIN_M`` rows (with the K-major copy stored): ``("tc", config)`` or
    ``("dequant", None)``; None below (the striped kernels' own choice).  Host ints only:
    graph-safe, no sync.  ``can_dequant``: whether the layer has the dequantise scratch
    (default: a CUDA device, the striped layers' case)."""
    if getattr(layer, "int_tc_qweight", None) is None:
        return None
    from pagedllm.kernels.wna16_tc_config import tc_choice, tc_min_m

    if m < tc_min_m():
        return None
    kind, cfg = tc_choice(m, n, k, device)
    if kind == "prior" or cfg is None and kind == "tc":
        # not in the table: never GPU-checked (the priors gave wrong results / illegal
        # addresses on an H200 before the split-K fix): the striped kernels' own choice
        return None
    lim = dequant_min_m()
    can_dequant = lim > 0 and (device.type == "cuda" if can_dequant is None
                               else can_dequant)  # the scratch exists
    if kind == "dequant":
        return ("dequant", None) if can_dequant else None
    return "tc", cfg


def _kmajor_route(layer: LinearBase, m: int, n: int, k: int,
                  device: torch.device) -> tuple[str, tuple[int, ...] | None]:
    """A ``kmajor`` layer's kernel for ``m`` rows (module doc): ``("gemv", None)``,
    ``("tc", config)`` or ``("dequant", None)``.  Host ints only: graph-safe, no sync."""
    if m <= KMAJOR_GEMV_MAX_M:
        return "gemv", None
    scratch = getattr(layer, "int_scratch", None) is not None
    route = _tc_route(layer, m, n, k, device, can_dequant=scratch)
    if route is not None:
        return route
    lim = dequant_min_m()
    if scratch and 0 < lim <= m:
        return "dequant", None
    from pagedllm.kernels.wna16_tc_config import tc_config

    return "tc", tc_config(m, n, k, device)


def apply_cuda(layer: LinearBase, x2: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K] @ W^T`` for a layer stored by :func:`store_cuda` (no bias)."""
    perm = layer.int_perm  # type: ignore[attr-defined]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    m = x2.shape[0]
    tiny = layer.int_tinygemm  # type: ignore[attr-defined]
    if tiny is not None and m <= tinygemm_max_m():
        return mm_parts(x2, [tiny])
    layout = layer.int_layout  # type: ignore[attr-defined]
    if layout == "kmajor":
        return _apply_kmajor(layer, x2)
    if layout == "stripe":
        return _apply_striped(layer, x2)
    from pagedllm.kernels.wna16 import wna16_gemm

    return wna16_gemm(x2, layer.int_qweight, layer.int_scales,  # type: ignore[arg-type]
                      layer.int_zeros, layer.int_g_idx, layer.int_bits,  # type: ignore[arg-type]
                      layer.int_group)  # type: ignore[arg-type]


def _apply_striped(layer: LinearBase, x2: torch.Tensor) -> torch.Tensor:
    """The ``stripe`` layout (and its K-major copy, if stored): module doc."""
    from pagedllm.kernels.wna16_stripe import stripe_gemm

    qw, s, z = layer.int_qweight, layer.int_scales, layer.int_zeros  # type: ignore[attr-defined]
    bits, group = layer.int_bits, layer.int_group  # type: ignore[attr-defined]
    m = x2.shape[0]
    route = _tc_route(layer, m, qw.shape[0], x2.shape[1], x2.device)
    if route is not None and route[0] == "tc":
        from pagedllm.kernels.wna16_tc import w4a16_tc_gemm

        return w4a16_tc_gemm(x2, layer.int_tc_qweight,  # type: ignore[attr-defined]
                             layer.int_tc_scales,  # type: ignore[attr-defined]
                             layer.int_tc_zeros, group, route[1])  # type: ignore[attr-defined,arg-type]
    lim = dequant_min_m()
    if (route is not None or 0 < lim <= m) and x2.is_cuda:
        return dequant_linear(x2, qw, s, z, bits, group, _scratch(x2.device, x2.dtype))
    return stripe_gemm(x2, qw, s, z, bits, group)


def _apply_kmajor(layer: LinearBase, x2: torch.Tensor) -> torch.Tensor:
    """The ``kmajor`` layout: :func:`_kmajor_route`'s kernel."""
    qw, s = layer.int_tc_qweight, layer.int_tc_scales  # type: ignore[attr-defined]
    z, group = layer.int_tc_zeros, layer.int_group  # type: ignore[attr-defined]
    k = x2.shape[1]
    kind, cfg = _kmajor_route(layer, x2.shape[0], qw.shape[1], k, x2.device)
    if kind == "gemv":
        from pagedllm.kernels.wna16_kmajor import kmajor_gemv

        return kmajor_gemv(x2, qw, s, z, group)
    if kind == "dequant":
        return kmajor_dequant_linear(x2, qw, s, z, group,
                                     layer.int_scratch.tensor)  # type: ignore[attr-defined]
    from pagedllm.kernels.wna16_tc import w4a16_tc_gemm

    return w4a16_tc_gemm(x2, qw, s, z, group, cfg)  # type: ignore[arg-type]
