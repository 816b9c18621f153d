"""Per-step attention metadata: the one contract between the model runner and every
attention backend (torch reference on CPU, Triton on GPU).

A step's batch is *flattened*: the new tokens of all scheduled requests are laid end to
end, request after request, in the order of ``query_start_loc``.  A request's new tokens
may be a whole prompt, a prompt chunk (chunked prefill, possibly after cached context),
or a single decode token -- attention does not care which ("no phases").

```
 tokens:       [ r0 r0 r0 r0 | r1 | r2 r2 | r3 ]        num_actual_tokens = 8
 query_start_loc: 0           4    5       7    8        (int32, [num_reqs + 1])
 seq_lens:        ctx0+4       ctx1+1  ctx2+2  ctx3+1      (context incl. the new tokens)
 block_tables:    one row per request, block ids, padded with 0
 slot_mapping:    per token, block_id * block_size + offset  (int64, -1 = do not write)
```

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 = keys, 1 = values).  With hybrid KV cache groups
(``core/kv_cache_groups.py``) layers of different groups share a tensor, and each group
has its own block tables and slot mapping: ``kv_groups[g]`` is group ``g``'s metadata
(the rest shared), which a layer of group ``g`` reads (``Attention.group_meta``).

The new token ``i`` of request ``r`` sits at absolute position
``seq_lens[r] - query_len[r] + i`` and attends causally to every cached position ``<=``
its own -- or, with ``query_limits`` (a model whose image tokens attend to their whole
image, ``models/gemma3_mm.py``), to every position ``<= query_limits[t]``::

 positions:     5  6  7  8  9 10          <img> = 6..9 (one image's placeholder run)
 query_limits:  5  9  9  9  9 10          keys <= 9 for the image's queries
 (a sliding window still drops keys ``<= position - W``)

A limit is never below the token's position and never past its request's ``seq_len -
1`` (the keys are written in the same step: the scheduler keeps such runs whole); a
one-token query's limit is therefore its own position, and decode paths ignore limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward pass.

    Device tensors live on the model's device; the ``*_cpu`` twins are host copies that
    the runner already has (it built them), so backends that need host-side sizes (the
    torch reference, kernel grid planning) never sync the device to get them.
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64 (padded tokens: -1)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host
    block_size: int
    # Hybrid KV cache groups: every group's metadata, this one first (index 0); empty
    # with one group (and in the per-group copies themselves).
    kv_groups: tuple[AttentionMetadata, ...] = ()
    # [num_tokens] int32 on the device: the last key position each query may see (module
    # doc); None -- every step of every other model -- is plain causal attention.
    query_limits: torch.Tensor | None = None
    # False in a CUDA graph's metadata (worker/cuda_graphs.py): the ``*_cpu`` twins are
    # then placeholders fixed at capture, so a backend may plan from the host ints above
    # (tokens, requests, ``max_query_len``) but never from the twins' contents.
    host_lens: bool = True
    # Set in a step that loads KV blocks back from the prefix cache's host tier
    # (worker/block_ops.py): each attention layer calls it with its KV tensor before
    # touching it, so it reads the loaded blocks only once they have landed.
    kv_ready: Callable[[torch.Tensor], None] | None = None

    def with_groups(self, tables: list[torch.Tensor], slots: list[torch.Tensor],
                    ) -> AttentionMetadata:
        """Attach groups 1..'s block tables and slot mappings (``kv_groups``)."""
        if tables:
            import dataclasses

            self.kv_groups = (self, *(dataclasses.replace(self, block_tables=t,
                                                          slot_mapping=s)
                                      for t, s in zip(tables, slots)))
        return self

    def with_kv_ready(self, ready: Callable[[torch.Tensor], None] | None,
                      ) -> AttentionMetadata:
        """Set ``kv_ready`` here and on every KV cache group's copy."""
        self.kv_ready = ready
        for g in self.kv_groups:
            g.kv_ready = ready
        return self

    def with_query_limits(self, limits: torch.Tensor | None) -> AttentionMetadata:
        """Set ``query_limits`` here and on every KV cache group's copy."""
        self.query_limits = limits
        for g in self.kv_groups:
            g.query_limits = limits
        return self

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]
