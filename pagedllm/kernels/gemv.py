"""Matrix-vector product for batch-1 decode: ``y = x W^T (+ b)`` with one row in ``x``,
optionally with the gated-MLP activation fused in front (``x = silu(g) * u``, or Gemma's
``gelu_tanh(g) * u``).

At decode batch 1 a linear layer is a pure read of its weight: 2 bytes per weight, one
FMA each.  For Llama's thin projections (``qkv``: 6144 x 4096, ``o_proj``: 4096 x 4096)
cuBLAS picks split-K kernels that read at ~3 TB/s and add a reduce kernel each; this
kernel is one launch.  Fusing SiLU-and-mul into ``down_proj``'s read of its input removes
the activation kernel (and its round trip through memory) from every layer.

Layout: each program owns ``BLOCK_N`` consecutive output features and walks the whole K
dimension in ``BLOCK_K`` steps, so every weight row is read as one contiguous stream and
no partial sums cross programs (no split-K workspace, no atomics: results are
deterministic for a given launch configuration).  The accumulator is an elementwise
``[BLOCK_N, BLOCK_K]`` fp32 tile, reduced along K once at the end, so the loop body is
loads and FMAs only.  K is a compile-time constant (a layer's input size: a handful per
model), which lets the K loop be unrolled.

The sum is ordered differently from cuBLAS's, so outputs differ from ``F.linear`` within
fp32 accumulation error, then one rounding to the output dtype.  Whether a layer uses this
kernel depends only on its row count (a host int), never on data: CUDA-graph capture and
eager runs of the same batch size take the same path.

FP8 (``layers/quantization/fp8.py`` at batch 1): with e4m3 ``x`` and ``W`` and their
scales (``x_scale [1, 1]``, ``w_scale [N]``) the kernel computes the W8A8 product
``(x_q . W_q[n]) * x_scale * w_scale[n] (+ b)``, the same operands as the batched
``torch._scaled_mm`` path, reading one byte per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.activation import gelu_tanh_mul_tile, silu_mul_tile
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait


@dataclass(frozen=True)
class GemvLoRA:
    """The operands a batch-1 GEMV's epilogue needs to add one row's adapter delta:
    ``partials [SPLIT, S*R]`` fp32 (:func:`lora_shrink`; summed over SPLIT they are the
    row's shrink), ``bt [L, S*R, N]`` (contiguous), ``slots [1]`` int32 (-1: no adapter,
    the output is then bit-for-bit the plain GEMV's), ``rank`` R and the shard bounds
    ``(B1, B2)`` (N where absent: ``kernels/lora.py``'s stacked layout)."""

    partials: torch.Tensor
    bt: torch.Tensor
    slots: torch.Tensor
    rank: int
    bounds: tuple[int, int]

    @property
    def split(self) -> int:
        return self.partials.shape[0]


@triton.jit
def _load_x(x_ptr, ks, k_ok, K: tl.constexpr, SILU_MUL: tl.constexpr, MASKED: tl.constexpr,
            GELU: tl.constexpr = False):
    """The input chunk ``ks`` in fp32.  With ``SILU_MUL``, ``x = silu(gate) * up`` from
    ``[gate | up]`` (K each), rounded as ``kernels/activation.silu_mul_tile`` rounds it;
    with ``GELU`` too, ``gelu_tanh(gate) * up`` (``gelu_tanh_mul_tile``)."""
    if SILU_MUL:
        if MASKED:
            g = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0)
        else:
            g = tl.load(x_ptr + ks)
            u = tl.load(x_ptr + K + ks)
        if GELU:
            return gelu_tanh_mul_tile(g, u).to(tl.float32)
        return silu_mul_tile(g, u).to(tl.float32)
    if MASKED:
        return tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return tl.load(x_ptr + ks).to(tl.float32)


@triton.jit
def _load_w(w_rows, ks, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:  # static: unmasked, vectorised loads
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)


@triton.jit
def _row_dots(x_ptr, w_rows, w0, rk, K: tl.constexpr, SILU_MUL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GELU: tl.constexpr = False):
    """``sum_k w[n, k] * x[k]`` in fp32 for the program's ``BLOCK_N`` rows ``w_rows``,
    given their first K tile ``w0`` (fetched by the caller, before its PDL wait).  The
    accumulator is an elementwise ``[BLOCK_N, BLOCK_K]`` tile reduced once at the end, so
    the loop body is loads and FMAs only."""
    x0 = _load_x(x_ptr, rk, rk < K, K, SILU_MUL, K % BLOCK_K != 0, GELU)
    out = tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
    if BLOCK_K < K:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + rk
            w = _load_w(w_rows, ks, K, BLOCK_K)
            x = _load_x(x_ptr, ks, ks < K, K, SILU_MUL, K % BLOCK_K != 0, GELU)
            acc += w.to(tl.float32) * x[None, :]
        out += tl.sum(acc, axis=1)
    return out


@triton.jit
def _lora_bt(slots_ptr, bt_ptr, stride_bs, cols, n0, N, B1, B2, R: tl.constexpr,
             BLOCK_R: tl.constexpr):
    """LoRA epilogue, part 1, before the PDL wait (the slot is step metadata, Bt a
    weight): the program's ``[BLOCK_R, len(cols)]`` tile of its slot's ``Bt`` for output
    columns ``cols`` (all in the shard of column ``n0``: ``kernels/lora.py``'s stacked
    layout, shards starting at ``B1`` and ``B2``), those rank rows, and whether the row
    has an adapter."""
    slot = tl.load(slots_ptr)
    has = slot >= 0
    shard = (n0 >= B1).to(tl.int32) + (n0 >= B2).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    rows = shard * R + r
    m = ((r < R) & has)[:, None] & (cols < N)[None, :]
    b = tl.load(bt_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + rows[:, None] * N
                + cols[None, :], mask=m, other=0.0)
    return b, rows, has


@triton.jit
def _lora_partials(t_ptr, rows, R: tl.constexpr, SR: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """LoRA epilogue, part 2, right after the PDL wait (``kernels/lora.lora_shrink``
    wrote them just before): the ``[SPLIT, BLOCK_R]`` partial shrinks of ``rows``,
    loaded before the K loop so that their latency hides behind it."""
    s = tl.arange(0, SPLIT)
    m = (s < SPLIT)[:, None] & (tl.arange(0, BLOCK_R) < R)[None, :]
    return tl.load(t_ptr + s[:, None] * SR + rows[None, :], mask=m, other=0.0)


@triton.jit
def _lora_add(y, b, p, has):
    """LoRA epilogue, part 3: ``y`` (the output rounded to its dtype) plus ``t @ b`` in
    fp32, ``t`` the sum of the partials ``p`` (fixed order), rounded once more -- as the
    unfused path adds the delta in place; ``y`` untouched (bit-for-bit) without an
    adapter."""
    t = tl.sum(p, axis=0)
    d = tl.sum(t[:, None] * b.to(tl.float32), axis=0)
    return tl.where(has, (y.to(tl.float32) + d).to(y.dtype), y)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, xs_ptr, ws_ptr, ls_ptr, lt_ptr, lb_ptr, N,
                 stride_wn, stride_lb, B1, B2,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                 SCALED: tl.constexpr = False, HAS_LORA: tl.constexpr = False,
                 LORA_R: tl.constexpr = 1, LORA_SR: tl.constexpr = 1,
                 LORA_SPLIT: tl.constexpr = 1, LORA_BLOCK_R: tl.constexpr = 1,
                 GELU: tl.constexpr = False):
    pdl_trigger(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    # Out-of-range rows re-read row N-1 instead of being masked, so that the weight loads
    # along K stay unmasked and vectorised; those rows are never stored.
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    w_rows = w_ptr + rn_safe[:, None] * stride_wn
    # The first K step of the weights is fetched before waiting for the previous kernel
    # (PDL, kernels/pdl.py): weights are never written by a kernel, x is.  (Fetching two
    # steps measured the same on an H200, four were slower: register spills.)
    rk = tl.arange(0, BLOCK_K)
    w0 = _load_w(w_rows, rk, K, BLOCK_K)
    if HAS_LORA:  # the adapter's Bt tile, with the first weight tile
        lb, lrows, lhas = _lora_bt(ls_ptr, lb_ptr, stride_lb, rn_safe, pid * BLOCK_N, N,
                                   B1, B2, LORA_R, LORA_BLOCK_R)
    pdl_wait(USE_PDL)
    if HAS_LORA:
        lp = _lora_partials(lt_ptr, lrows, LORA_R, LORA_SR, LORA_SPLIT, LORA_BLOCK_R)
    out = _row_dots(x_ptr, w_rows, w0, rk, K, SILU_MUL, BLOCK_N, BLOCK_K, GELU)
    if SCALED:  # fp8: per-token x scale times per-channel w scales
        out = out * tl.load(xs_ptr) * tl.load(ws_ptr + rn_safe)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = out.to(y_ptr.dtype.element_ty)
    if HAS_LORA:
        y = _lora_add(y, lb, lp, lhas)
    tl.store(y_ptr + rn, y, mask=n_mask)


def gemv_config(n: int, k: int, weight_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight of ``weight_bytes`` bytes per element.
    16-bit: 8 output rows per program gives 512+ programs for N >= 4096 (several per SM,
    enough bytes in flight).  In an H200 sweep of the Llama-3-8B projections
    (``benchmarks/gemm_sweep.py``, graph-timed, 24 configurations each) this was within
    1-2 µs of the best everywhere; a run with the per-shape "best" configurations (and
    another change) had a slower decode step, so one config stays.  8-bit (e4m3): 4 rows
    of 2,048 inputs a step, within 0.1 µs of the best of 8 configurations at every 8B
    projection on an H200 (graph replay over weight copies): 62.6 µs a layer's four
    linears against 79.0 with the 16-bit config (qkv 8.75 -> 8.52, o 7.82 -> 5.48,
    gate_up 38.61 -> 30.56, down 23.82 -> 18.00 µs)."""
    if weight_bytes == 1:
        return 4, min(2048, triton.next_power_of_2(k)), 4
    return 8, min(512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int] | None = None, x_scale: torch.Tensor | None = None,
         w_scale: torch.Tensor | None = None, lora: GemvLoRA | None = None,
         gelu_tanh_mul: bool = False) -> torch.Tensor:
    """``x: [1, K]`` (``[1, 2K]`` = ``[gate | up]`` when ``silu_mul``; contiguous),
    ``weight: [N, K]`` with contiguous rows, ``bias: [N]`` or None -> ``[1, N]`` in
    ``x``'s dtype (``out``'s when given).  ``config`` overrides :func:`gemv_config` (for
    tuning).  ``x_scale`` ``[1, 1]`` / ``w_scale`` ``[N]`` (fp32): the scales of e4m3
    ``x`` and ``weight`` (see the module doc); pass ``out`` in the model dtype.
    ``lora``: an adapter's delta for this row (``kernels/lora.lora_shrink``, which ran
    the shrink), added in the epilogue to the rounded output and rounded again.
    ``gelu_tanh_mul``: ``x`` is ``[gate | up]`` read as ``gelu_tanh(gate) * up``
    (Gemma's MLP; without an adapter)."""
    if gelu_tanh_mul and lora is not None:
        raise ValueError("gemv: gelu_tanh_mul takes no LoRA delta")
    silu_mul = silu_mul or gelu_tanh_mul
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes exactly one row, got x of shape {tuple(x.shape)}")
    if x.shape[1] != (2 * k if silu_mul else k) or weight.stride(1) != 1 \
            or not x.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {(n, k)} "
                         f"(silu_mul={silu_mul}) or is not contiguous")
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k, weight.element_size())
    scaled = x_scale is not None
    assert scaled == (w_scale is not None), "x_scale and w_scale go together"
    lora_args, lora_consts = _lora_launch(lora, n, out)
    if lora is not None:  # a program's rows must lie in one shard
        while any(b < n and b % block_n for b in lora.bounds):
            block_n //= 2
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        x_scale if scaled else out, w_scale if scaled else out, *lora_args[:3], n,
        weight.stride(0), *lora_args[3:], K=k, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, GELU=gelu_tanh_mul, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALED=scaled,
        num_warps=warps, **lora_consts, **pdl_launch_args(x.device))
    return out


def _lora_launch(lora: GemvLoRA | None, n: int, placeholder: torch.Tensor,
                 ) -> tuple[tuple, dict]:
    """A GEMV kernel's LoRA epilogue arguments ``(slots, partials, bt, bt slot stride,
    B1, B2)`` and constants (placeholders and ``HAS_LORA=False`` without one)."""
    if lora is None:
        return (placeholder, placeholder, placeholder, 0, 0, 0), {}
    assert lora.bt.shape[2] == n and lora.bt.is_contiguous()
    assert lora.split == triton.next_power_of_2(lora.split)
    sr = lora.partials.shape[1]
    return (lora.slots, lora.partials, lora.bt, lora.bt.stride(0), *lora.bounds), dict(
        HAS_LORA=True, LORA_R=lora.rank, LORA_SR=sr, LORA_SPLIT=lora.split,
        LORA_BLOCK_R=triton.next_power_of_2(lora.rank))
