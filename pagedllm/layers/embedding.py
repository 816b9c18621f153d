"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

Rank r owns vocabulary rows ``[r*V/tp, (r+1)*V/tp)``.  The embedding looks up only its
own ids (others give zero) and all-reduces; the head computes its slice of the logits
and all-gathers.  The group is the TP group of the parallel context the model is built
in (``distributed/parallel_state.py``).  At ``tp_size=1`` both are a plain lookup / matmul.

A ``QuantizationConfig`` may give either an ``EmbeddingMethodBase`` (by ``prefix``,
``model.embed_tokens`` / ``lm_head``) that stores the table compactly; a tied head then
multiplies by the embedding's storage (``tie_to``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import tp_group
from pagedllm.layers.quantization.base import EmbeddingMethodBase, QuantizationConfig


class VocabParallelEmbedding(nn.Module):
    """``[T] long -> [T, hidden]``.  ``weight: [vocab_per_partition, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int | None = None,
                 tp_rank: int | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.tp_group = tp_group(tp_size, tp_rank)
        tp_size, tp_rank = self.tp_group.world_size, self.tp_group.rank_in_group
        if vocab_size % tp_size:
            raise ValueError(f"vocab_size {vocab_size} not divisible by "
                             f"tensor_parallel_size {tp_size}")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.per_partition = vocab_size // tp_size
        self.vocab_start = tp_rank * self.per_partition
        self.quant_method: EmbeddingMethodBase | None = (
            quant_config.get_embedding_method(self, prefix) if quant_config else None)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, torch.get_default_dtype())
            return
        self.weight = nn.Parameter(torch.empty(self.per_partition, hidden_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"shape mismatch: expected checkpoint shape "
                             f"{(self.vocab_size, self.hidden_size)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.per_partition))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.per_partition)
        out = F.embedding(local.clamp(0, self.per_partition - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``hidden -> vocab``.  ``tie_to(embedding)`` shares the
    embedding's weight (``tie_word_embeddings``); the checkpoint's ``lm_head.weight`` is
    then ignored."""

    tied_to: tuple[VocabParallelEmbedding, ...] = ()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        # A tuple, not a submodule: the embedding is registered (and processed) once.
        self.tied_to = (embedding,)
        self.quant_method = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[N, hidden] -> [N, vocab]`` logits in the weight's dtype (the sampler casts
        to float32 where it needs to: a greedy argmax does not, as bf16 -> fp32 is exact)."""
        source = self.tied_to[0] if self.tied_to else self
        if source.quant_method is not None:
            logits = source.quant_method.logits(source, hidden)
        else:
            logits = F.linear(hidden, self.weight)
        # Every rank gets the whole logits and samples the same tokens (vLLM V1's
        # all-gather): no broadcast of the sampled ids is then needed within a stage.
        return self.tp_group.all_gather(logits, dim=-1)
