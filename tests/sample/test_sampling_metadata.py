"""SamplingMetadata.build: fast paths, field contents, and per-step cost."""

from __future__ import annotations

import torch
from sampler_helpers import CPU, Req

from pagedllm.sample import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

V = 32


class NoIterList(list[int]):
    """An output-token list whose elements must not be read (len() is fine)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("builder iterated the generated tokens")

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        raise AssertionError("builder indexed the generated tokens")


def test_all_greedy_fast_path_has_nothing_else() -> None:
    meta = SamplingMetadata.build([Req(SamplingParams(temperature=0.0))] * 3, CPU, V)
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature is None and meta.greedy_mask is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None and meta.logit_bias is None
    assert meta.min_tokens_mask is None and meta.max_num_logprobs is None


def test_mixed_batch_fields() -> None:
    reqs = [Req(SamplingParams(temperature=0.0)),
            Req(SamplingParams(temperature=0.5, top_k=4, seed=3, logprobs=2)),
            Req(SamplingParams(top_p=0.5, top_k=1000, logprobs=5))]
    meta = SamplingMetadata.build(reqs, CPU, V)
    assert not meta.all_greedy and not meta.all_random
    assert meta.greedy_mask is not None and meta.greedy_mask.tolist() == [True, False, False]
    assert meta.temperature is not None and meta.temperature.tolist() == [1.0, 0.5, 1.0]
    assert meta.top_k is not None and meta.top_k.tolist() == [V, 4, V]
    assert meta.max_top_k == 4
    assert meta.top_p is not None and meta.min_p is None
    assert set(meta.generators) == {1}
    assert meta.max_num_logprobs == 5


def test_build_cost_does_not_touch_generated_tokens_without_penalties() -> None:
    out = NoIterList(range(10_000))
    reqs = [Req(SamplingParams(top_k=3, logit_bias={1: 1.0}, min_tokens=5, logprobs=1),
                output_token_ids=out, prompt_token_ids=list(range(100)), eos_token_id=0),
            Req(SamplingParams(temperature=0.0), output_token_ids=out)]
    meta = SamplingMetadata.build(reqs, CPU, V)
    assert meta.penalties is None and meta.min_tokens_mask is None


def test_penalty_tensors_only_for_penalised_rows() -> None:
    reqs = [Req(SamplingParams(), output_token_ids=NoIterList([1, 2])),
            Req(SamplingParams(frequency_penalty=1.0), prompt_token_ids=[5, 5, 6],
                output_token_ids=[2, 2, 9, V + 4]),
            Req(SamplingParams(temperature=0.0, repetition_penalty=1.5))]
    meta = SamplingMetadata.build(reqs, CPU, V)
    pen = meta.penalties
    assert pen is not None
    assert pen.rows.tolist() == [1, 2]
    assert pen.output_counts.shape == (2, V) and pen.output_counts.dtype == torch.int32
    assert pen.output_counts[0, 2] == 2 and pen.output_counts[0, 9] == 1
    assert int(pen.output_counts[0].sum()) == 3  # the out-of-vocab id was dropped
    assert pen.prompt_mask[0].nonzero().flatten().tolist() == [5, 6]
    assert not pen.prompt_mask[1].any() and not pen.output_counts[1].any()
    assert pen.frequency.tolist() == [1.0, 0.0] and pen.repetition.tolist() == [1.0, 1.5]
