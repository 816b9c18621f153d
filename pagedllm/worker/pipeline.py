"""One pipeline stage's step: receive hidden states, run its layers, send them on.

::

    stage 0            stage 1                 stage pp-1 (last)
    embed, layers  ─►  recv, layers  ─► ... ─► recv, layers, norm, lm_head, sample
      send(h, res)       send(h, res)                    │
         ▲                                               │ sampled ids
         └──────────── broadcast over the world ◄────────┘

Every stage builds the same step inputs from the same ``SchedulerOutput`` (positions,
block tables, slot mapping), so only the activations travel: two ``[T, hidden]``
tensors point-to-point over the PP group (gloo on CPU, NCCL on GPU; ``T`` is the step's
token count, which every rank knows, so no shapes are exchanged).  The last stage's
sampled token ids are broadcast to every rank because each runner appends them to its
own rows (the next decode's input ids, the token counts).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import ParallelState


class PipelineStage:
    """The point-to-point half of a pipeline-parallel step (see the module doc)."""

    def __init__(self, parallel: ParallelState, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pp, self.world = parallel.pp, parallel.world
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        # The last stage's TP rank 0 returns the step's output (vLLM's output rank).
        self.output_rank = parallel.world_size - parallel.tp_size

    @property
    def is_last(self) -> bool:
        return self.pp.is_last

    def forward(self, model: nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_only: bool) -> torch.Tensor | None:
        """This stage's part of the forward: the final hidden states on the last stage,
        None elsewhere (after sending them on)."""
        inter = None
        if not self.pp.is_first:
            t = ids.shape[0]
            inter = tuple(self.pp.recv(torch.empty(t, self.hidden_size, dtype=self.dtype,
                                                   device=self.device),
                                       self.pp.rank_in_group - 1) for _ in range(2))
        out = model(ids, positions, meta, last_only, inter)
        if self.pp.is_last:
            return out
        hidden, residual = out
        nxt = self.pp.rank_in_group + 1
        self.pp.send(hidden, nxt)
        self.pp.send(residual, nxt)
        return None

    def share_sampled(self, ids: torch.Tensor | None, n: int) -> torch.Tensor:
        """The ``n`` sampled token ids of this step on every rank: ``ids`` from the last
        stage (None elsewhere), broadcast from the output rank."""
        if ids is None:
            ids = torch.empty(n, dtype=torch.int64, device=self.device)
        src = self.world.ranks.index(self.output_rank)
        return self.world.broadcast(ids, src)
