"""The KV cache's element type: ``kv_cache_dtype="auto"`` (the model dtype) or ``"fp8"``
(alias ``"fp8_e4m3"``).

An fp8 cache stores ``k / k_scale`` and ``v / v_scale`` rounded to e4m3 (saturating at
+-448), with one per-tensor scale per layer for keys and one for values: 1.0 by default,
the checkpoint's ``self_attn.k_scale`` / ``v_scale`` when it has them (compressed-tensors'
``kv_cache_scheme``; ``models/loader.py`` reads them).  Attention dequantises what it
reads (``x * scale``) before its products, so only the cache's bytes halve: the memory
planner fits twice the blocks of a bf16 cache (``ModelConfig.kv_bytes_per_token``).

Backends declare which element types they serve (``AttentionBackend.kv_cache_dtypes``);
the worker checks the configured one with ``check_backend`` before allocating.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def kv_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch element type of a cache of ``cache_dtype`` for a model in ``model_dtype``."""
    return FP8_KV_DTYPE if cache_dtype == "fp8" else model_dtype


def check_backend(backend: object, cache_dtype: str) -> None:
    """``ValueError`` naming ``kv_cache_dtype`` if ``backend`` cannot serve it."""
    served = tuple(getattr(backend, "kv_cache_dtypes", ("auto",)))
    if cache_dtype not in served:
        name = getattr(backend, "name", type(backend).__name__)
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported by the {name} "
                         f"attention backend; supported: {', '.join(served)}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as saturated e4m3 (the reference of the Triton KV writes).

    The divisor is a 0-d tensor on ``x``'s device, not a Python float: CUDA torch turns
    division by a host scalar into multiplication by its reciprocal, which is off by one
    ulp at times, and a quotient one ulp off an e4m3 rounding midpoint then rounds to the
    other neighbour (an H200 run saw 7 of ~1.6 M elements differ from the Triton write,
    which divides exactly: ``tl.div_rn``).  Divided this way every device rounds the
    IEEE quotient."""
    div = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / div).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)
