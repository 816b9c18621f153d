"""Sampling: per-step metadata and the torch sampler (also the reference for GPU kernels)."""

from pagedllm.sample.metadata import SamplingMetadata, SamplingRequestView
from pagedllm.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    compute_prompt_logprobs,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRequestView",
    "compute_prompt_logprobs",
]
