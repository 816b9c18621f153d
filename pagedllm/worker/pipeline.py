"""One pipeline stage's step: receive hidden states, run its layers, send them on.

::

    stage 0            stage 1                 stage pp-1 (last)
    embed, layers  ─►  recv, layers  ─► ... ─► recv, layers, norm, lm_head, sample
      send(h, res)       send(h, res)                    │ sampled ids
         ▲                                               ▼ (output rank -> engine core)
         └──── with a later step: SampledTokens ◄── executor

Every stage builds the same step inputs from the same ``SchedulerOutput`` (positions,
block tables, slot mapping), so only the activations travel: two ``[T, hidden]``
tensors point-to-point over the PP group (gloo on CPU, NCCL on GPU; ``T`` is the step's
token count, which every rank knows, so no shapes are exchanged).

The stages before the last never wait for the sampled tokens: the executor sends them
along with the next step it launches (``SampledTokens``, recorded by
``ModelRunner.record_sampled_tokens`` before that step runs).  So stage 0 can run the
next micro-batch while the last stage samples this one -- the engine core keeps up to
``pipeline_parallel_size`` batches of disjoint requests in flight
(``EngineCore._step_pipelined``), and a request is scheduled again only after its
tokens came back, hence before any stage needs them.
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
        self.pp = parallel.pp
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device

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
