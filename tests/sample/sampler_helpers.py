"""Shared helpers for the sampler tests: a plain request view and a one-call sampler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.sample import Sampler, SamplerOutput, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")


@dataclass
class Req:
    """Satisfies ``SamplingRequestView``; builds its generator from ``params.seed``."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator(CPU).manual_seed(self.params.seed)


def sample(logits: torch.Tensor, reqs: Sequence[Req]) -> SamplerOutput:
    meta = SamplingMetadata.build(reqs, CPU, logits.shape[-1])
    return Sampler()(logits, meta)
