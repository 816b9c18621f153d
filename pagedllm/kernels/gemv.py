"""Matrix-vector product for batch-1 decode: ``y = x W^T (+ b)`` with one row in ``x``,
optionally with the gated-MLP activation fused in front (``x = silu(g) * u``).

At decode batch 1 a linear layer is a pure read of its weight: 2 bytes per weight, one
FMA each.  For Llama's thin projections (``qkv``: 6144 x 4096, ``o_proj``: 4096 x 4096)
cuBLAS picks split-K kernels that read at ~3 TB/s and add a reduce kernel each; this
kernel is one launch.  Fusing SiLU-and-mul into ``down_proj``'s read of its input removes
the activation kernel (and its round trip through memory) from every layer.

Layout: each program owns ``BLOCK_N`` consecutive output features and walks the whole K
dimension in ``BLOCK_K`` steps, so every weight row is read as one contiguous stream and
no partial sums cross programs (no split-K workspace, no atomics: results are
deterministic and do not depend on the launch grid).  The accumulator is an elementwise
``[BLOCK_N, BLOCK_K]`` fp32 tile, reduced along K once at the end, so the loop body is
loads and FMAs only.  K is a compile-time constant (a layer's input size: a handful per
model), which lets the K loop be unrolled.

The sum is ordered differently from cuBLAS's, so outputs differ from ``F.linear`` within
fp32 accumulation error, then one rounding to the output dtype.  Whether a layer uses this
kernel depends only on its row count (a host int), never on data: CUDA-graph capture and
eager runs of the same batch size take the same path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.rotary import _rope


@triton.jit
def _load_x(x_ptr, ks, k_ok, K: tl.constexpr, SILU_MUL: tl.constexpr, MASKED: tl.constexpr):
    """The input chunk ``ks`` in fp32.  With ``SILU_MUL``, ``x = silu(gate) * up`` from
    ``[gate | up]`` (K each), rounded exactly as ``kernels/activation.py`` rounds it: silu
    in fp32 -> dtype, then the product -> dtype."""
    if SILU_MUL:
        if MASKED:
            g = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0)
        else:
            g = tl.load(x_ptr + ks)
            u = tl.load(x_ptr + K + ks)
        gf = g.to(tl.float32)
        act = tl.div_rn(gf, 1.0 + tl.exp(-gf)).to(g.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    if MASKED:
        return tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return tl.load(x_ptr + ks).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    # Out-of-range rows re-read row N-1 instead of being masked, so that the weight loads
    # along K stay unmasked and vectorised; those rows are never stored.
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    w_rows = w_ptr + rn_safe[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if K % BLOCK_K == 0:  # static: unmasked, vectorised loads
            w = tl.load(w_rows + ks[None, :])
            x = _load_x(x_ptr, ks, ks < K, K, SILU_MUL, False)
        else:
            w = tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
            x = _load_x(x_ptr, ks, ks < K, K, SILU_MUL, True)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps).  8 output rows per program gives 512+ programs for
    N >= 4096 (several per SM, enough bytes in flight).  In an H200 sweep of the
    Llama-3-8B projections (``benchmarks/gemm_sweep.py``, graph-timed, 24 configurations
    each) this was within 1-2 µs of the best everywhere; a run with the per-shape "best"
    configurations (and another change) had a slower decode step, so one config stays."""
    return 8, min(512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x: [1, K]`` (``[1, 2K]`` = ``[gate | up]`` when ``silu_mul``; contiguous),
    ``weight: [N, K]`` with contiguous rows, ``bias: [N]`` or None -> ``[1, N]`` in
    ``x``'s dtype.  ``config`` overrides :func:`gemv_config` (for tuning)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes exactly one row, got x of shape {tuple(x.shape)}")
    if x.shape[1] != (2 * k if silu_mul else k) or weight.stride(1) != 1 \
            or not x.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {(n, k)} "
                         f"(silu_mul={silu_mul}) or is not contiguous")
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, weight.stride(0), K=k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return out


@triton.jit
def _gemv_qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_wn, stride_c, stride_cb, stride_cs, stride_ch,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    PER_HEAD: tl.constexpr = HALF // R
    pid = tl.program_id(0)
    head = pid // PER_HEAD
    # This program's R rotation pairs (i, i + HALF) of one q, k or v head: both rows of
    # each pair are computed here, so the rotation happens in registers.
    i = (pid % PER_HEAD) * R + tl.arange(0, R)
    rows1 = head * HEAD_DIM + i
    rows2 = rows1 + HALF
    w1_rows = w_ptr + rows1.to(tl.int64)[:, None] * stride_wn
    w2_rows = w_ptr + rows2.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if K % BLOCK_K == 0:
            x = tl.load(x_ptr + ks).to(tl.float32)
            w1 = tl.load(w1_rows + ks[None, :])
            w2 = tl.load(w2_rows + ks[None, :])
        else:
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            w1 = tl.load(w1_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
            w2 = tl.load(w2_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
        acc1 += w1.to(tl.float32) * x[None, :]
        acc2 += w2.to(tl.float32) * x[None, :]
    y1 = tl.sum(acc1, axis=1)
    y2 = tl.sum(acc2, axis=1)
    if HAS_BIAS:
        y1 += tl.load(b_ptr + rows1).to(tl.float32)
        y2 += tl.load(b_ptr + rows2).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    y1 = y1.to(dt)  # the projection's output rounding, as the unfused path stores it
    y2 = y2.to(dt)
    # Rotate q and k heads exactly as kernels/rotary.py does (cos/sin cast to the
    # activation dtype; every product and sum rounded); v heads pass through.
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_c + i).to(dt).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_c + HALF + i).to(dt).to(tl.float32)
    r1, r2 = _rope(y1[None, :], y2[None, :], cos, sin)
    rotate = head < NUM_Q_HEADS + NUM_KV_HEADS
    y1 = tl.where(rotate, tl.reshape(r1, (R,)), y1)
    y2 = tl.where(rotate, tl.reshape(r2, (R,)), y2)
    tl.store(y_ptr + rows1, y1)
    tl.store(y_ptr + rows2, y2)
    if head >= NUM_Q_HEADS:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:  # -1: CUDA-graph padding, nothing to store
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            kv = head - NUM_Q_HEADS
            if kv < NUM_KV_HEADS:
                base = k_cache_ptr + dst + kv * stride_ch
            else:
                base = v_cache_ptr + dst + (kv - NUM_KV_HEADS) * stride_ch
            tl.store(base + i, y1.to(k_cache_ptr.dtype.element_ty))
            tl.store(base + HALF + i, y2.to(k_cache_ptr.dtype.element_ty))


def gemv_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Batch-1 decode: the fused QKV projection, neox rotary on q and k, and the KV-cache
    write, in one launch.  Returns the ``[1, (Hq + 2 Hkv) * D]`` projection with q (and
    k) rotated; the rotated k and the v are also stored at ``slot_mapping[0]`` (-1:
    skipped) of ``kv_cache`` (``[2, num_blocks, block_size, Hkv, D]``).

    Equals ``gemv`` then ``rotary.rotary_and_write_kv`` (full rotary, neox style), which
    round the same way: the caller's attention then reads q from the result and k/v
    from the cache.
    """
    n, k = weight.shape
    if x.shape != (1, k) or not x.is_contiguous() or weight.stride(1) != 1:
        raise ValueError(f"gemv_qkv_rope: x {tuple(x.shape)} vs weight {(n, k)}")
    if n != (num_q_heads + 2 * num_kv_heads) * head_dim or head_dim % 8:
        raise ValueError(f"gemv_qkv_rope: {n} outputs is not ({num_q_heads} + 2 x "
                         f"{num_kv_heads}) heads of {head_dim}")
    if cos_sin_cache.shape[-1] != head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError("gemv_qkv_rope needs full-width rotary (cos_sin_cache [P, D])")
    r = 4  # 8 rows per program, as gemv_config
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (n // (2 * r),)
    _gemv_qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else weight, out, positions, cos_sin_cache,
        slot_mapping, k_cache, v_cache, weight.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        K=k, HAS_BIAS=bias is not None, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], R=r,
        BLOCK_K=gemv_config(n, k)[1], num_warps=4)
    return out
