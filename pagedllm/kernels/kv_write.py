"""Store a step's new keys and values into the paged KV cache.

Cache layout (one tensor per layer, see ``pagedllm.attention.metadata``)::

    kv_cache[0 | 1, block_id, offset_in_block, kv_head, dim]     0 = keys, 1 = values

Token ``t`` goes to ``slot_mapping[t] = block_id * block_size + offset``; a slot of -1
(padding tokens of a CUDA-graph batch) is skipped, so the kernel never writes outside
the blocks the scheduler handed out.

An fp8 cache (``attention/kv_cache_dtype.py``) gets ``x / scale`` saturated to +-448 and
rounded to e4m3 in registers (``to_cache``; the rotary kernel's fused write uses it too).

One program per token writes all of that token's KV heads; the grid is ``key.shape[0]``
(a host int), so the launch is CUDA-graph safe.  Offsets are built in int64 because
``block_id * block_stride`` overflows int32 once a cache has more than ~2**31 elements
(e.g. 70k blocks of 16 x 8 x 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fp8_quant import round_e4m3


@triton.jit
def to_cache(x, scale, cache_ptr, FP8: tl.constexpr):
    """``x`` as the cache stores it: ``x / scale`` saturated and rounded to e4m3 for an
    fp8 cache (``kv_cache_dtype.quantize_kv``), else converted to the cache's type."""
    if FP8:
        # div_rn: IEEE division, as torch divides (the GPU default is approximate).
        return round_e4m3(tl.div_rn(x.to(tl.float32), scale)).to(
            cache_ptr.dtype.element_ty)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr, FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = tok * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = tok * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = block_id * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    # Converted to the cache's element type (e.g. fp32 activations, bf16 or fp8 cache).
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr, FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr, FP8), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Scatter ``key``/``value`` (``[num_tokens, num_kv_heads, head_dim]``) into
    ``kv_cache`` (``[2, num_blocks, block_size, num_kv_heads, head_dim]``) at
    ``slot_mapping`` (``[>= num_tokens]`` int64, -1 = skip).

    ``k_scale`` / ``v_scale``: the per-tensor scales of an fp8 cache (ignored otherwise).
    Only the last dimension of key/value must be contiguous (they may be views into a
    fused QKV projection output).  The cache must have a contiguous last dimension too.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (
        kv_cache.shape, key.shape)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(k_scale),
        float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
