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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, heads, i, imask, cos, sin,
                  HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    mask = (heads[:, None] < num_heads) & imask[None, :]
    p1 = base_ptr + heads[:, None] * stride_h + off1[None, :]
    p2 = base_ptr + heads[:, None] * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Round every product and sum to the activation dtype, like the eager HF code.
    a = (x1f * cos[None, :]).to(dt).to(tl.float32)
    b = (x2f * sin[None, :]).to(dt).to(tl.float32)
    c = (x2f * cos[None, :]).to(dt).to(tl.float32)
    d = (x1f * sin[None, :]).to(dt).to(tl.float32)
    tl.store(p1, (a - b).to(dt), mask=mask)
    tl.store(p2, (c + d).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_c, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, HEADS_P2: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    imask = i < HALF
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=imask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + i, mask=imask, other=0.0)
    # HF casts cos/sin to the activation dtype before multiplying.
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    heads = tl.arange(0, HEADS_P2)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, heads, i, imask, cos, sin,
                  HALF, IS_NEOX)
    if HAS_KEY:
        _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, heads, i, imask, cos,
                      sin, HALF, IS_NEOX)


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
