"""The sampler on a CUDA device: no host syncs, seeded rows batch-independent, parity.

Skipped without CUDA.  Run on a GPU machine with ``pytest tests/sample -m gpu``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from pagedllm.sample import Sampler, SamplerOutput, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

V = 49152  # a real vocabulary size (SmolLM2)


@dataclass
class CudaReq:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = 2
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator("cuda").manual_seed(self.params.seed)


def run(logits: torch.Tensor, reqs: Sequence[CudaReq]) -> SamplerOutput:
    meta = SamplingMetadata.build(reqs, logits.device, logits.shape[-1])
    torch.cuda.synchronize()
    # Any device->host sync inside the sampler raises here.
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out


def all_features() -> list[CudaReq]:
    return [
        CudaReq(SamplingParams(temperature=0.0, logprobs=5)),
        CudaReq(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=11,
                               logprobs=2)),
        CudaReq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.3, logit_bias={5: 3.0}, min_tokens=4),
                prompt_token_ids=list(range(100, 400)), output_token_ids=[7, 7, 8]),
        CudaReq(SamplingParams(top_p=0.5)),
        CudaReq(SamplingParams(top_k=1)),
    ]


def test_no_host_sync_and_outputs_on_device() -> None:
    logits = torch.randn(5, V, device="cuda")
    out = run(logits, all_features())
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (5, 6)
    assert int(out.sampled_token_ids[0]) == int(logits[0].argmax())
    assert int(out.sampled_token_ids[4]) == int(logits[4].argmax())


def test_processing_matches_cpu() -> None:
    logits = torch.randn(5, V) * 3
    reqs = all_features()
    cpu_meta = SamplingMetadata.build(
        [CudaReq(r.params, r.prompt_token_ids, r.output_token_ids) for r in reqs],
        torch.device("cpu"), V)
    gpu_meta = SamplingMetadata.build(reqs, torch.device("cuda"), V)
    want = Sampler.apply_logits_processors(logits, cpu_meta)
    got = Sampler.apply_logits_processors(logits.cuda(), gpu_meta).cpu()
    torch.testing.assert_close(got, want)


def test_seeded_rows_independent_of_batch_on_gpu() -> None:
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, seed=1234)
    step_logits = [torch.randn(V, device="cuda", generator=torch.Generator("cuda")
                               .manual_seed(s)) for s in range(6)]

    def tokens(batch: int, position: int) -> list[int]:
        target = CudaReq(params)
        others = [CudaReq(SamplingParams(temperature=1.2, seed=None if i % 2 else i))
                  for i in range(batch - 1)]
        got = []
        for x in step_logits:
            rows = list(others)
            rows.insert(position, target)
            logits = torch.randn(batch, V, device="cuda")
            logits[position] = x
            got.append(int(run(logits, rows).sampled_token_ids[position]))
        return got

    alone = tokens(1, 0)
    assert tokens(4, 2) == alone
    assert tokens(64, 17) == alone
    assert tokens(256, 255) == alone
