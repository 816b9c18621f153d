"""``calculate_kv_scales``: per-layer fp8 KV-cache scales from the first real forward.

vLLM's semantics (``--calculate-kv-scales``; its ``Attention.calc_kv_scales``): with an
fp8 KV cache, each attention layer sets, on the first forward that carries real tokens,

    k_scale = amax(|key|)   / K_SCALE_CONSTANT      (200, vLLM's ``K_SCALE_CONSTANT``)
    v_scale = amax(|value|) / V_SCALE_CONSTANT      (100, vLLM's ``V_SCALE_CONSTANT``)

and keeps them for the engine's lifetime (they override a checkpoint's scales, as in
vLLM).  The constants leave headroom (448 / 200 = 2.24x for keys, 4.48x for values) for
later tokens beyond the first batch's range; values above it saturate at +-448.  Why
it matters: with the default scales of 1.0, a model whose K/V values are mostly well
below 1 stores many of them as e4m3 subnormals (|x| < 2^-6, 3 bits or fewer of
precision); scaling the largest value to ~200 puts the bulk in the normal range.

Keys are measured after the rotary embedding (what the cache stores); a backend that
fuses the rotation into its KV write gets unrotated keys, so they are rotated here once.

Who decides when: the model runner arms the layers (``arm``) for the first step it runs
with real tokens -- never the memory profile run, the kernel warm-up or a CUDA-graph
capture, whose inputs are dummies -- and runs that step eagerly (its CUDA graphs are
captured after it, with the final scales baked in: ``worker/model_runner.py``).  The
scales are host floats (one ``.item()`` per layer, on that one step only).
"""

from __future__ import annotations

import torch
from torch import nn

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
# An all-zero first batch (or layer) must not give a zero scale (x / 0).
_MIN_SCALE = 1e-8


def scales_from_amax(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """``(k_scale, v_scale)`` for this batch's keys and values (any shape)."""
    k = float(key.abs().amax().float()) if key.numel() else 0.0
    v = float(value.abs().amax().float()) if value.numel() else 0.0
    return max(k / K_SCALE_CONSTANT, _MIN_SCALE), max(v / V_SCALE_CONSTANT, _MIN_SCALE)


def arm(model: nn.Module) -> int:
    """Have every attention layer of ``model`` compute its scales on its next forward;
    returns how many layers were armed."""
    n = 0
    for module in model.modules():
        if hasattr(module, "calculate_kv_scales") and hasattr(module, "k_scale"):
            module.calculate_kv_scales = True
            n += 1
    return n
