"""KV cache groups: which layers share a block table (vLLM's hybrid KV cache manager).

A model whose layers mix full attention with sliding-window attention (Gemma 2: 1 local
: 1 global, Gemma 3: 5 : 1) keeps one block table per *group* of layers of one kind, so
that a sliding group can give back the blocks that have left its window while the full
group keeps the whole context.  All groups draw their blocks from **one** pool, and a
block id is one page in each of ``num_tensors`` KV tensors that the groups *share*:

```
 Gemma-3-12B: 48 layers, 8 full + 40 sliding  ->  group size 8, 6 groups, 8 KV tensors
   group 0 (full)    layers  5 11 17 23 29 35 41 47    -> tensors 0..7
   group 1 (sliding) layers  0  1  2  3  4  6  7  8    -> tensors 0..7
   ...
   group 5 (sliding) layers 40 42 43 44 45 46 ..       -> tensors 0..7
 block id b: page b of tensors 0..7; owned by one group of one request at a time
```

A block therefore costs ``group_size`` layers of KV (not ``num_layers``), a full-context
token costs one block slot per full group, and a sliding group holds about
``window / block_size + 1`` blocks per request whatever the context length.  With one
attention kind (or ``disable_hybrid_kv_cache_manager``) there is one group of every
layer, each with its own tensor: the classic layout, where a block is a page of every
layer and the only window freeing is that of a model whose layers all slide alike.

The group size is the smallest kind's layer count (vLLM's rule); a kind whose count is
not a multiple of it ends with a smaller group, whose blocks leave some tensors' pages
unused (Gemma-3-27B: 62 layers, 10 full + 52 sliding -> the last sliding group has 2).
This module is plain Python: the scheduler's KV manager and the worker both read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (model order) and their window (None = full attention)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds in this group at
        once: all of them under full attention; under a window, the window's blocks
        (one more when it straddles a block edge) plus a step's new tokens (at most
        ``max_chunk``), which are written before the window slides past them."""
        full = _cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, _cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1)


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's groups, and where each layer's KV lives.

    ``layer_group[l]``: the group of layer ``l``; ``layer_tensor[l]``: the index of the
    KV tensor that layer ``l`` reads and writes (shared with one layer of each other
    group when ``hybrid``); ``num_tensors``: how many KV tensors the worker allocates.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    num_tensors: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def blocks_per_request(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one request of ``num_tokens`` tokens may hold at once (all groups)."""
        return sum(g.max_blocks(num_tokens, block_size, max_chunk) for g in self.groups)

    def describe(self) -> str:
        """One line for the start-up log: each group's kind and layer count."""
        kinds = [f"{'full' if g.sliding_window is None else f'sliding {g.sliding_window}'}"
                 f" x{len(g.layer_ids)}" for g in self.groups]
        return (f"{len(self.groups)} KV cache group(s) [{', '.join(kinds)}] over "
                f"{self.num_tensors} KV tensor(s)")


def single_group(layer_windows: Sequence[int | None]) -> KVCacheGroups:
    """Every layer in one group with its own tensor; the group slides only when every
    layer has the same window."""
    n = len(layer_windows)
    windows = set(layer_windows)
    window = windows.pop() if len(windows) == 1 else None
    return KVCacheGroups((KVCacheGroupSpec(tuple(range(n)), window),), (0,) * n,
                         tuple(range(n)), n)


def make_kv_cache_groups(layer_windows: Sequence[int | None],
                         hybrid: bool = True) -> KVCacheGroups:
    """Group layers by attention kind (``layer_windows[l]``: layer ``l``'s window, None
    = full).  One kind, or ``hybrid=False`` (``--disable-hybrid-kv-cache-manager``):
    ``single_group``.  Otherwise kinds are cut into groups of the smallest kind's layer
    count, full-attention groups first."""
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(layer)
    if not hybrid or len(kinds) <= 1:
        return single_group(layer_windows)
    size = min(len(v) for v in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first
    groups: list[KVCacheGroupSpec] = []
    layer_group = [0] * len(layer_windows)
    layer_tensor = [0] * len(layer_windows)
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), size):
            chunk = tuple(layers[start:start + size])
            for j, layer in enumerate(chunk):
                layer_group[layer] = len(groups)
                layer_tensor[layer] = j
            groups.append(KVCacheGroupSpec(chunk, w))
    return KVCacheGroups(tuple(groups), tuple(layer_group), tuple(layer_tensor), size)
