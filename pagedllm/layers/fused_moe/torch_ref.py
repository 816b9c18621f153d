"""The experts in plain PyTorch: the CPU path and the oracle of the Triton kernel.

```
 (token, slot) pairs ──sort by expert──► [e0 e0 e0 | e1 | e3 e3 ...]   (e2 had no tokens)
 for each expert with tokens:   h = x[tok] @ W13[e]^T          [n_e, 2I]
                                a = silu(h[:, :I]) * h[:, I:]  [n_e, I]
                                y = (a @ W2[e]^T) * w[pair]    [n_e, H]
                                out.index_add_(0, tok, y)
```

One grouped matmul per expert that has tokens -- never a loop over tokens.  The loop runs
over experts in ascending order and accumulates with ``index_add_`` exactly as
transformers' experts do, so float32 results agree with Hugging Face bit for bit.  The
per-expert token counts are read on the host once per call (a sync on a GPU; the GPU path
is ``kernels/fused_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sort_by_expert(topk_ids: torch.Tensor,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(pair order [T*k] int64, tokens per expert [E] int64)``.

    ``order`` lists the flattened (token, slot) pair indices ``t * k + j`` grouped by
    expert (stable: tokens ascending within an expert)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights/ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype: the sum over each token's
    experts of ``weight * down(silu(gate(x)) * up(x))``.  Pairs whose id is ``>= E``
    (another expert-parallel rank's expert) are skipped.

    ``w13_scale [E, 2I]`` / ``w2_scale [E, H]``: the weights are quantised (FP8) with a
    scale per output channel; each routed expert is upcast to ``x``'s dtype and its
    scale applied to its rows (``(w * s) x == s * (w x)``), one expert at a time, so no
    dequantised copy of the whole bank is ever made."""
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, num_experts)
    tokens = order // top_k
    weights = topk_weights.reshape(-1).index_select(0, order)
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    start = 0
    for e, n in enumerate(counts.tolist()[:num_experts]):
        if n == 0:
            continue
        tok = tokens[start:start + n]
        h = F.linear(x.index_select(0, tok), _expert(w13, w13_scale, e, x.dtype))
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(a, _expert(w2, w2_scale, e, x.dtype)) * weights[start:start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


def _expert(w: torch.Tensor, scale: torch.Tensor | None, e: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s matrix in ``dtype``: as stored, or upcast times its row scales."""
    if scale is None:
        return w[e]
    return (w[e].float() * scale[e].float()[:, None]).to(dtype)
