"""Poolers: one vector per sequence from a flattened batch of hidden states.

``hidden [T, H]`` holds the sequences end to end (``query_start_loc [R + 1]``, as in
attention metadata).  ``cls`` takes each sequence's first token (BGE), ``mean`` averages
its tokens (E5, sentence-transformers' default), ``last`` takes its last token (decoder
embedding models: Qwen3-Embedding); ``normalize`` divides by the L2 norm.  One
``index_select`` or ``segment`` reduction per batch: no loop over sequences.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PoolingType = Literal["cls", "mean", "last"]


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling: PoolingType,
         normalize: bool = False) -> torch.Tensor:
    """``[R, H]`` in float32."""
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    h = hidden.float()
    if pooling == "cls":
        out = h.index_select(0, starts)
    elif pooling == "last":
        out = h.index_select(0, ends - 1)
    elif pooling == "mean":
        lens = ends - starts
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=h.device), lens)
        out = torch.zeros(lens.numel(), h.shape[1], device=h.device).index_add_(0, seq, h)
        out = out / lens.unsqueeze(1).to(out.dtype)
    else:
        raise ValueError(f"pooling must be cls, mean or last, got {pooling!r}")
    return F.normalize(out, dim=-1) if normalize else out
