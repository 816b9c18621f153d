"""RMSNorm (with the residual add) that also computes the next projection's LoRA shrink,
for batch-1 decode: ``qkv_proj`` and ``gate_up_proj`` read the normalised row, so their
shrink ``t = norm(x) A^T`` needs no launch of its own (``kernels/lora.lora_shrink`` would
be one per projection, and at one row launches are the cost).

The norm of ``kernels/norm.py`` runs one program per row; this one runs the shrink's
grid, ``SPLIT`` K chunks x ``S`` shards.  Every program reads the whole row (8 KB at
4096, from L2) for the statistics, then normalises its own chunk and multiplies it by
its [R, CHUNK] tile of A (fetched before the PDL wait: weights), writing fp32 partials
``[SPLIT, S*R]`` as ``lora_shrink`` does; program (0, 0) also stores the normalised row
and the new residual.  Every program runs the same sums in the same layout (``BLOCK``,
the warps) as ``kernels/norm.py``, so the stored row is bit-identical to that kernel's,
and each chunk the shrink multiplies is bit-identical to the stored row's (the GEMV that
adds the expand reads the stored row).  Outputs are new tensors: the programs read
``x`` and ``residual`` while program (0, 0) writes, so nothing is in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import GemvLoRA
from pagedllm.kernels.lora import shrink_config
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait


@triton.jit
def _norm_row(x, r, HAS_RESIDUAL: tl.constexpr):
    """``x (+ residual)`` rounded to the activation dtype, as ``kernels/norm.py``."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rms_norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, slots_ptr, a_ptr, t_ptr, stride_as,
    n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr,
    R: tl.constexpr, SR: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_trigger(USE_PDL)
    j = tl.program_id(0)  # K chunk
    first = (j == 0) & (tl.program_id(1) == 0)
    rows = tl.program_id(1) * R + tl.arange(0, BLOCK_R)  # this shard's rank rows
    r_ok = tl.arange(0, BLOCK_R) < R
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    ks = j * CHUNK + tl.arange(0, CHUNK)
    k_ok = ks < K
    # Before the PDL wait: the norm weight, the slot (step metadata) and the A tile.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wk = tl.load(w_ptr + ks, mask=k_ok, other=0.0)
    slot = tl.load(slots_ptr)
    has = slot >= 0  # without an adapter the A tile is masked off: zeros stored
    a = tl.load(a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + rows[:, None] * K
                + ks[None, :], mask=r_ok[:, None] & (k_ok & has)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x = _norm_row(tl.load(x_ptr + cols, mask=mask, other=0.0),
                  tl.load(res_ptr + cols, mask=mask, other=0.0), HAS_RESIDUAL)
    xk = _norm_row(tl.load(x_ptr + ks, mask=k_ok, other=0.0),
                   tl.load(res_ptr + ks, mask=k_ok, other=0.0), HAS_RESIDUAL)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    inv = tl.math.rsqrt(var + eps)
    if first:
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + cols, x, mask=mask)
        y = (xf * inv).to(x_ptr.dtype.element_ty)
        out = y.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    # The chunk as stored (rounded twice, as above), then its part of the shrink.
    yk = (xk.to(tl.float32) * inv).to(x_ptr.dtype.element_ty)
    ok = (yk.to(tl.float32) * wk.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(t_ptr + j * SR + rows, tl.sum(a.to(tl.float32) * ok.to(tl.float32)[None, :],
                                           axis=1), mask=r_ok)


def rms_norm_shrink(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                    shard_bounds: tuple[int, ...],
                    ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], GemvLoRA]:
    """``kernels/norm.rms_norm(x)`` (``residual`` None) or ``fused_add_rms_norm(x,
    residual)`` for one row ``x [1, K]`` -- same values, new tensors -- and, in the same
    launch, the LoRA shrink of the normalised row for the projection that reads it
    (``slots [1]``, ``a [L, S*R, K]``, ``bt [L, S*R, N]``, ``shard_bounds``: as
    ``kernels/lora.lora_shrink``).  Returns ``(norm's result, GemvLoRA)``."""
    n_slots, sr, k = a.shape
    n = bt.shape[2]
    n_shards = len(shard_bounds) + 1
    if x.shape != (1, k) or not x.is_contiguous() or weight.shape != (k,) \
            or n_shards > 3 or sr % n_shards:
        raise ValueError(f"rms_norm_shrink: x {tuple(x.shape)} / a {tuple(a.shape)} / "
                         f"{n_shards} shards do not fit")
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous())
    assert a.is_contiguous() and bt.is_contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    r = sr // n_shards
    chunk, _ = shrink_config(k)
    split = triton.next_power_of_2(triton.cdiv(k, chunk))
    partials = torch.empty(split, sr, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _rms_norm_shrink_kernel[(split, n_shards)](
        x, residual if residual is not None else x, weight, out, res_out, slots, a,
        partials, a.stride(0), k, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        K=k, R=r, SR=sr, CHUNK=chunk, BLOCK_R=triton.next_power_of_2(r),
        # kernels/norm.py's warps: the same layout, so the same sums (module doc)
        num_warps=min(16, max(1, block // 256)), **pdl_launch_args(x.device))
    bounds = tuple(shard_bounds) + (n,) * (2 - len(shard_bounds))
    lora = GemvLoRA(partials, bt, slots, r, (bounds[0], bounds[1]))
    return (out if residual is None else (out, res_out)), lora
