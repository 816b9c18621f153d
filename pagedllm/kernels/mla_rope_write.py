"""The MLA layer's prologue in one launch: rotate ``q_pe``, normalise the latent ``c_kv``,
rotate ``k_pe`` and store ``[c_kv | k_pe]`` into the paged latent cache.

```
 q   [T, H, Dn | R]  (q_proj / q_b_proj output; q_pe = its last R of each head)
 ckv [T, L | R]      (kv_a_proj_with_mqa output: c_kv, then k_pe)
        │ one program per token
        ├─► q_pe rotated            ─► q_pe_out [T, H, R]
        └─► rms_norm(c_kv) * w, k_pe rotated ─► kv_cache[slot] = [c_kv | k_pe]
```

In torch (``layers/mla.py``) this is ~17 launches a layer: the norm, the cos/sin gather
and cast, the rotation's products, sums and concatenations, the entry's concatenation and
the scatter.  At batch 1 every one is a few-µs kernel of a CUDA graph; DeepSeek-V2-Lite
has 27 layers.

Numerics are the torch path's step for step (so the cache holds what ``MLATorchBackend.
write`` would write and greedy output is unchanged): the norm is ``kernels/norm.py``'s
(fp32 statistics, normalised value rounded to the activation dtype, then times the
weight, rounded); the rotation is ``kernels/rotary.py``'s (cos/sin cast to the
activation dtype, every product and the sum rounded to it); an fp8 cache gets
``entry / k_scale`` saturated and rounded to e4m3 (``kv_write.to_cache``).  The rotated
pairs come out de-interleaved (``x0 cos - x1 sin`` for every pair, then ``x1 cos + x0
sin``) whatever the pair layout, as ``layers/mla.py`` stores them: only ``q_pe . k_pe``
is ever used, and the two agree.

Rows ``>= num_actual_tokens`` and slots of -1 (CUDA-graph padding) write nothing to the
cache; ``q_pe_out`` is written for every row.  The grid is the row count (a host int):
CUDA-graph safe, no device->host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.kv_write import to_cache
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start
from pagedllm.kernels.rotary import _cos_sin, _pair_offsets, _rope


@triton.jit
def _mla_rope_write_kernel(
    pos_ptr, q_ptr, ckv_ptr, w_ptr, cs_ptr, slot_ptr, cache_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_c, stride_slot, stride_ot, stride_oh,
    num_heads, num_actual, eps, k_scale,
    NOPE: tl.constexpr, LAT: tl.constexpr, LAT_P2: tl.constexpr, HALF: tl.constexpr,
    HALF_P2: tl.constexpr, H_P2: tl.constexpr, IS_NEOX: tl.constexpr,
    USE_PDL: tl.constexpr, FP8: tl.constexpr,
):
    pdl_start(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    imask = i < HALF
    cos, sin = _cos_sin(pos_ptr, cs_ptr, stride_c, tok, i, imask, q_ptr, HALF)
    off1, off2 = _pair_offsets(i, HALF, IS_NEOX)
    # q_pe of every head, rotated into q_pe_out (de-interleaved).
    heads = tl.arange(0, H_P2)
    hmask = (heads[:, None] < num_heads) & imask[None, :]
    src = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + NOPE
    y1, y2 = _rope(tl.load(src + off1[None, :], mask=hmask, other=0.0),
                   tl.load(src + off2[None, :], mask=hmask, other=0.0), cos, sin)
    dst = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + i[None, :]
    tl.store(dst, y1, mask=hmask)
    tl.store(dst + HALF, y2, mask=hmask)
    if tok >= num_actual:
        return
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # CUDA-graph padding: nothing to store
    entry = cache_ptr + slot * stride_slot
    # c_kv: RMSNorm with kernels/norm.py's roundings.
    cols = tl.arange(0, LAT_P2)
    cmask = cols < LAT
    x = tl.load(ckv_ptr + tok * stride_kt + cols, mask=cmask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / LAT
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    c_kv = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(entry + cols, to_cache(c_kv, k_scale, cache_ptr, FP8), mask=cmask)
    # k_pe (one head), rotated like q_pe.
    kp = ckv_ptr + tok * stride_kt + LAT
    kmask = imask[None, :]
    z1, z2 = _rope(tl.load(kp + off1[None, :], mask=kmask, other=0.0),
                   tl.load(kp + off2[None, :], mask=kmask, other=0.0), cos, sin)
    kdst = entry + LAT + i[None, :]
    tl.store(kdst, to_cache(z1, k_scale, cache_ptr, FP8), mask=kmask)
    tl.store(kdst + HALF, to_cache(z2, k_scale, cache_ptr, FP8), mask=kmask)


def mla_rope_norm_write(q: torch.Tensor, ckv: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_actual_tokens: int, qk_nope_head_dim: int, *,
                        interleaved: bool, k_scale: float = 1.0) -> torch.Tensor:
    """The module's one launch -> ``q_pe_out [T, H, R]`` (q's dtype, contiguous).

    ``q [T, H, Dn + R]`` (token / head strides free, last dim contiguous); ``ckv [T, L +
    R]`` (rows strided, last dim contiguous); ``norm_weight [L]``; ``positions [T]``;
    ``cos_sin_cache [max_position, R]`` (``cat(cos, sin)``, any float dtype);
    ``kv_cache (1, num_blocks, block_size, 1, L + R)`` contiguous, in q's dtype, another
    float dtype or e4m3 (``k_scale`` then divides the entry); ``slot_mapping [>= T]``
    (-1 = skip); rows ``>= num_actual_tokens`` are not stored.  ``interleaved``: the
    checkpoint rotates pairs ``(x[2i], x[2i+1])`` (DeepSeek-V2, V3's ``rope_interleave``)
    rather than halves (neox)."""
    t, h, d = q.shape
    rope = cos_sin_cache.shape[-1]
    lat = ckv.shape[-1] - rope
    if d != qk_nope_head_dim + rope or ckv.shape[0] != t or lat <= 0 or rope % 2 \
            or kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1 \
            or kv_cache.shape[4] != lat + rope or norm_weight.shape != (lat,):
        raise ValueError(f"mla_rope_norm_write: q {tuple(q.shape)}, ckv {tuple(ckv.shape)}, "
                         f"cos_sin_cache {tuple(cos_sin_cache.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, norm_weight {tuple(norm_weight.shape)}: "
                         "expected [T, H, Dn + R], [T, L + R], [P, R], (1, N, B, 1, L + R), "
                         "[L]")
    if q.stride(-1) != 1 or ckv.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1 \
            or not kv_cache.is_contiguous():
        raise ValueError("mla_rope_norm_write: q, ckv and cos_sin_cache need a contiguous "
                         "last dim, kv_cache a contiguous layout")
    out = torch.empty(t, h, rope, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    half = rope // 2
    _mla_rope_write_kernel[(t,)](
        positions, q, ckv, norm_weight, cos_sin_cache, slot_mapping, kv_cache, out,
        q.stride(0), q.stride(1), ckv.stride(0), cos_sin_cache.stride(0),
        kv_cache.stride(2), out.stride(0), out.stride(1), h, int(num_actual_tokens),
        float(eps), float(k_scale),
        NOPE=qk_nope_head_dim, LAT=lat, LAT_P2=triton.next_power_of_2(lat), HALF=half,
        HALF_P2=triton.next_power_of_2(half), H_P2=triton.next_power_of_2(h),
        IS_NEOX=not interleaved, FP8=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if max(lat, h * half) >= 1024 else 2, **pdl_launch_args(q.device),
    )
    return out
