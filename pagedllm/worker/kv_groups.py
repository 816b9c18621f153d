"""Binding the KV tensors to layers under KV cache groups (``core/kv_cache_groups.py``).

With one group every layer gets its own tensor.  With hybrid groups, layer ``l`` gets
tensor ``layer_tensor[l]`` -- shared with one layer of each other group, since a block id
belongs to one group at a time -- and its attention reads group ``layer_group[l]``'s
block tables and slot mapping (``Attention.kv_group``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.layers.attention import Attention

logger = logging.getLogger(__name__)


def bind_kv_cache_groups(model: nn.Module, tensors: list[torch.Tensor],
                         groups: KVCacheGroups | None, start: int, end: int) -> None:
    """Bind layers ``[start, end)`` (this rank's) to ``tensors`` and their groups."""
    if groups is None or not groups.hybrid:
        model.bind_kv_caches(tensors)  # type: ignore[operator]
        return
    model.bind_kv_caches([tensors[groups.layer_tensor[i]]  # type: ignore[operator]
                          for i in range(start, end)])
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if len(attns) != end - start:
        raise RuntimeError(f"hybrid KV cache groups: the model has {len(attns)} attention "
                           f"layers, its config {end - start}; run with "
                           "--disable-hybrid-kv-cache-manager")
    for i, attn in zip(range(start, end), attns):
        attn.kv_group = groups.layer_group[i]
    logger.info("%s; a block holds %d layers' KV", groups.describe(), groups.num_tensors)
    for g, spec in enumerate(groups.groups):
        kind = "full" if spec.sliding_window is None else \
            f"sliding window {spec.sliding_window}"
        logger.info("KV cache group %d (%s): layers %s", g, kind,
                    ",".join(map(str, spec.layer_ids)))
