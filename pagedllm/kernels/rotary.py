"""Rotary position embeddings applied in place to q and k.

Cos/sin cache layout (vLLM's): ``cos_sin_cache[pos] = cat(cos[pos], sin[pos])``, shape
``[max_position, rot_dim]``, where ``cos[pos, i] = cos(pos * inv_freq[i])`` for
``i < rot_dim // 2`` (any float dtype; fp32 recommended -- values are cast to q's dtype
as Hugging Face casts ``cos``/``sin`` to ``x.dtype``).  ``rot_dim <= head_dim``: only the
first ``rot_dim`` dims of each head rotate (partial rotary); the rest are untouched.

Styles:

* neox (``is_neox=True``, Llama/Qwen/Mistral HF checkpoints): pairs are
  ``(x[i], x[i + rot_dim/2])``.
* GPT-J (``is_neox=False``): pairs are ``(x[2i], x[2i + 1])``.

For pair ``(x1, x2)`` at angle ``i``: ``x1' = x1*cos - x2*sin``, ``x2' = x2*cos + x1*sin``,
each product and the sum rounded to q's dtype as HF's ``q*cos + rotate_half(q)*sin``
does in bf16, so results match Hugging Face bit for bit.

Two entry points: ``apply_rotary`` (q and k in place) and ``rotary_and_write_kv``, which
the GPU attention backend uses: one launch per layer rotates q in place and stores the
rotated k and the v straight into the paged KV cache (the same rounding, so the cache
holds exactly what ``apply_rotary`` + ``kv_write.write_kv_cache`` would write).

``rotary_and_write_kv`` also takes a layer's per-head q/k RMSNorms (Qwen3, Gemma 3;
``attention.rope.QKNorm``) where the rotation covers the whole head: each head is normed
from the rotation pairs already in registers, in the norm's own roundings (Llama's or
Gemma's, as ``kernels/norm.py``), before it is rotated -- two launches a layer fewer.
The statistics sum the two halves of a head separately, so they may differ from the
standalone norm kernel's in the last fp32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.kv_write import to_cache
from pagedllm.kernels.pdl import pdl_launch_args, pdl_start


@triton.jit
def _pair_offsets(i, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Offsets of the two elements of rotation pair ``i`` within a head."""
    if IS_NEOX:
        return i, i + HALF
    else:
        return 2 * i, 2 * i + 1


@triton.jit
def _rope(x1, x2, cos, sin):
    """Rotate pairs ``(x1, x2)``; results in x's dtype, rounded like HF's eager code
    (every product and the sum rounded to the activation dtype)."""
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a = (x1f * cos[None, :]).to(dt).to(tl.float32)
    b = (x2f * sin[None, :]).to(dt).to(tl.float32)
    c = (x2f * cos[None, :]).to(dt).to(tl.float32)
    d = (x1f * sin[None, :]).to(dt).to(tl.float32)
    return (a - b).to(dt), (c + d).to(dt)


@triton.jit
def _norm_pairs(x1, x2, w_ptr, off1, off2, imask, eps, HEAD_DIM: tl.constexpr,
                NORM: tl.constexpr):
    """Per-head RMSNorm of heads held as rotation pairs ``[H, HALF]`` (the rotation covers
    the head; masked lanes are 0).  ``NORM`` 1: Llama's (``w * (x * r).to(dt)``), 2:
    Gemma's (``x * r * (1 + w)`` in fp32); ``r = rsqrt(mean(x^2) + eps)``."""
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    r = tl.math.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + off1, mask=imask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + off2, mask=imask, other=0.0).to(tl.float32)[None, :]
    if NORM == 2:
        return (f1 * r * (1.0 + w1)).to(dt), (f2 * r * (1.0 + w2)).to(dt)
    y1 = (f1 * r).to(dt).to(tl.float32)
    y2 = (f2 * r).to(dt).to(tl.float32)
    return (y1 * w1).to(dt), (y2 * w2).to(dt)


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, heads, i, imask, cos, sin,
                  HALF: tl.constexpr, IS_NEOX: tl.constexpr, w_ptr=None, eps=0.0,
                  HEAD_DIM: tl.constexpr = 0, NORM: tl.constexpr = 0):
    off1, off2 = _pair_offsets(i, HALF, IS_NEOX)
    mask = (heads[:, None] < num_heads) & imask[None, :]
    p1 = base_ptr + heads[:, None] * stride_h + off1[None, :]
    p2 = base_ptr + heads[:, None] * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    if NORM:
        x1, x2 = _norm_pairs(x1, x2, w_ptr, off1, off2, imask, eps, HEAD_DIM, NORM)
    y1, y2 = _rope(x1, x2, cos, sin)
    tl.store(p1, y1, mask=mask)
    tl.store(p2, y2, mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, stride_c, tok, i, imask, q_ptr, HALF: tl.constexpr):
    """This token's cos/sin rows, cast to the activation dtype (as HF casts them before
    multiplying) and held in fp32."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=imask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + i, mask=imask, other=0.0)
    return (cos.to(q_ptr.dtype.element_ty).to(tl.float32),
            sin.to(q_ptr.dtype.element_ty).to(tl.float32))


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_c, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, HEADS_P2: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    imask = i < HALF
    cos, sin = _cos_sin(pos_ptr, cache_ptr, stride_c, tok, i, imask, q_ptr, HALF)
    heads = tl.arange(0, HEADS_P2)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, heads, i, imask, cos, sin,
                  HALF, IS_NEOX)
    if HAS_KEY:
        _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, heads, i, imask, cos,
                      sin, HALF, IS_NEOX)


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_cb, stride_cs, stride_ch, num_q_heads, k_scale, v_scale, qw_ptr, kw_ptr, eps,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, QH_P2: tl.constexpr, KH_P2: tl.constexpr,
    DIM_P2: tl.constexpr, IS_NEOX: tl.constexpr, USE_PDL: tl.constexpr,
    FP8: tl.constexpr, NORM: tl.constexpr,
):
    pdl_start(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    imask = i < HALF
    cos, sin = _cos_sin(pos_ptr, cache_ptr, stride_c, tok, i, imask, q_ptr, HALF)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, tl.arange(0, QH_P2), i,
                  imask, cos, sin, HALF, IS_NEOX, qw_ptr, eps, HEAD_DIM, NORM)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # CUDA-graph padding: nothing to store
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    kh = tl.arange(0, KH_P2)
    head_ok = kh[:, None] < NUM_KV_HEADS
    # Rotated key pairs go straight to the cache (the key buffer itself is not updated).
    off1, off2 = _pair_offsets(i, HALF, IS_NEOX)
    pair_ok = head_ok & imask[None, :]
    src = k_ptr + tok * stride_kt + kh[:, None] * stride_kh
    x1 = tl.load(src + off1[None, :], mask=pair_ok, other=0.0)
    x2 = tl.load(src + off2[None, :], mask=pair_ok, other=0.0)
    if NORM:
        x1, x2 = _norm_pairs(x1, x2, kw_ptr, off1, off2, imask, eps, HEAD_DIM, NORM)
    y1, y2 = _rope(x1, x2, cos, sin)
    kdst = k_cache_ptr + dst + kh[:, None] * stride_ch
    tl.store(kdst + off1[None, :], to_cache(y1, k_scale, k_cache_ptr, FP8), mask=pair_ok)
    tl.store(kdst + off2[None, :], to_cache(y2, k_scale, k_cache_ptr, FP8), mask=pair_ok)
    dims = tl.arange(0, DIM_P2)
    if 2 * HALF < HEAD_DIM:  # partial rotary: the tail of each key head is copied as is
        tail_ok = head_ok & (dims[None, :] >= 2 * HALF) & (dims[None, :] < HEAD_DIM)
        tail = tl.load(src + dims[None, :], mask=tail_ok, other=0.0)
        tl.store(kdst + dims[None, :], to_cache(tail, k_scale, k_cache_ptr, FP8),
                 mask=tail_ok)
    v_ok = head_ok & (dims[None, :] < HEAD_DIM)
    v = tl.load(v_ptr + tok * stride_vt + kh[:, None] * stride_vh + dims[None, :], mask=v_ok)
    tl.store(v_cache_ptr + dst + kh[:, None] * stride_ch + dims[None, :],
             to_cache(v, v_scale, v_cache_ptr, FP8), mask=v_ok)


def _as_heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[T, H*D]`` or ``[T, H, D]`` -> a ``[T, H, D]`` view (no copy: in place must stick)."""
    assert x.stride(-1) == 1, "last dimension must be contiguous"
    return x if x.dim() == 3 else x.view(x.shape[0], -1, head_size)


def apply_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
    head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True,
) -> None:
    """Rotate ``query`` (and ``key``) in place (vLLM's ``rotary_embedding`` signature).

    positions: ``[T]`` integer positions.  query ``[T, Hq*D]`` or ``[T, Hq, D]``; key
    likewise with its own head count, or None.  Both may be strided views into a fused
    QKV output as long as each head's ``D`` values are contiguous.  ``cos_sin_cache``:
    ``[max_position, rot_dim]`` laid out as described in the module docstring.
    """
    q = _as_heads(query, head_size)
    k = _as_heads(key, head_size) if key is not None else q
    num_tokens = q.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_size, (rot_dim, head_size)
    assert cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    half = rot_dim // 2
    heads = max(q.shape[1], k.shape[1])
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), q.shape[1], k.shape[1] if key is not None else 0,
        HALF=half, HALF_P2=triton.next_power_of_2(half),
        HEADS_P2=triton.next_power_of_2(heads), IS_NEOX=is_neox, HAS_KEY=key is not None,
        num_warps=4 if heads * half >= 1024 else 1,
    )


def rotary_and_write_kv(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    head_size: int, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, is_neox: bool = True, k_scale: float = 1.0,
    v_scale: float = 1.0, q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
    gemma_norm: bool = False,
) -> None:
    """One launch per layer: rotate ``query`` in place, and store the rotated ``key`` and
    the ``value`` into ``kv_cache`` at ``slot_mapping`` (-1 = skip, CUDA-graph padding);
    an fp8 cache stores them divided by ``k_scale`` / ``v_scale`` (``kv_write.to_cache``).

    Equivalent to ``apply_rotary(positions, query, key, ...)`` followed by
    ``pagedllm.kernels.kv_write.write_kv_cache(key, value, kv_cache, slot_mapping)``,
    except that ``key`` itself is left unrotated (attention reads keys from the cache).
    Shapes as in those two functions; ``kv_cache`` is one layer's
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.  ``q_norm_weight`` and
    ``k_norm_weight`` (``[head_dim]``, with ``norm_eps``): q and k are normed per head
    first, Gemma's way with ``gemma_norm`` (module doc; the rotation must cover the whole
    head: :func:`fuses_qk_norm`).
    """
    q = _as_heads(query, head_size)
    k = _as_heads(key, head_size)
    v = _as_heads(value, head_size)
    num_tokens, num_kv_heads = k.shape[0], k.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_size, (rot_dim, head_size)
    assert cos_sin_cache.stride(-1) == 1 and v.shape == k.shape, (v.shape, k.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.stride(4) == 1
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_size, (
        kv_cache.shape, k.shape)
    if num_tokens == 0:
        return
    half = rot_dim // 2
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    normed = q_norm_weight is not None and k_norm_weight is not None
    if normed and not fuses_qk_norm(head_size, rot_dim):
        raise ValueError(f"q_norm_weight: the fused norm needs a rotation over the whole "
                         f"head (rot_dim {rot_dim}, head_size {head_size})")
    norm = 0 if not normed else (2 if gemma_norm else 1)
    qw = q_norm_weight if normed else q
    kw = k_norm_weight if normed else q
    _rotary_kv_write_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q.shape[1], float(k_scale), float(v_scale), qw, kw,
        float(norm_eps),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_size, BLOCK_SIZE=kv_cache.shape[2],
        HALF=half, HALF_P2=triton.next_power_of_2(half),
        QH_P2=triton.next_power_of_2(q.shape[1]), KH_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_size), IS_NEOX=is_neox,
        FP8=kv_cache.dtype == torch.float8_e4m3fn, NORM=norm,
        num_warps=4 if q.shape[1] * half >= 1024 else 1, **pdl_launch_args(q.device),
    )


def fuses_qk_norm(head_size: int, rot_dim: int) -> bool:
    """Whether :func:`rotary_and_write_kv` can norm q and k: the rotation pairs must hold
    the whole head (no partial rotary)."""
    return rot_dim == head_size
