"""The rejection sampler preserves the target distribution (chi-square, many draws),
is exact for greedy rows, and is reproducible for seeded requests."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample

V = 6
N = 30_000  # requests (independent draws) per call
# Chi-square critical value for 5 degrees of freedom at level 0.001 (a correct sampler
# fails once in a thousand runs; the global RNG is seeded, so the test is deterministic).
# Rows masked by top-k/top-p have fewer degrees of freedom: the bound is then looser.
CHI2_5DF_999 = 20.515


class _Row:
    def __init__(self, params: SamplingParams, seed: int | None = None) -> None:
        self.params = params
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.prompt_token_ids = [0]
        self.output_token_ids: list[int] = []
        self.eos_token_id = None


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the ordinary sampler draws from, built independently."""
    x = logits / params.temperature
    if params.top_k > 0:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    if params.top_p < 1.0:
        sp, order = p.sort(descending=True)
        keep = (sp.cumsum(-1) - sp) < params.top_p
        p = torch.zeros_like(p).scatter(0, order, sp * keep)
        p = p / p.sum()
    return p


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    stat = 0.0
    for c, p in zip(counts.tolist(), probs.tolist()):
        if p == 0:
            assert c == 0, "sampled a token of probability 0"
            continue
        stat += (c - n * p) ** 2 / (n * p)
    return stat


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("draft", [0, 3])  # the most likely token; a less likely one
def test_first_and_second_tokens_follow_the_target(params, draft):
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
    logits2 = torch.tensor([-1.0, 0.2, 1.7, 0.4, -0.3, 0.9])  # after the draft
    # Each request: drafts [draft, 1] -> rows (before draft, after draft, bonus).
    rows = torch.stack([logits, logits2, logits]).repeat(N, 1)
    drafts = torch.tensor([draft, 1, -1]).repeat(N)
    meta = SamplingMetadata.build([_Row(params)] * (3 * N), torch.device("cpu"), V)
    out = rejection_sample(rows, drafts, torch.full((N,), 2), 2, meta)
    first = out.token_ids[:, 0]
    p1 = _target(logits, params)
    assert _chi2(torch.bincount(first, minlength=V), p1, N) < CHI2_5DF_999
    # Given the first token was the draft, the second follows the target after it.
    second = out.token_ids[first == draft, 1]
    if p1[draft] == 0:  # masked by top-k: never accepted
        assert len(second) == 0 and int(out.num_accepted.max()) == 0
        return
    p2 = _target(logits2, params)
    assert _chi2(torch.bincount(second, minlength=V), p2, len(second)) < CHI2_5DF_999
    assert (out.num_accepted > 0).float().mean() == pytest.approx(float(p1[draft]), abs=0.02)


def test_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0],
                           [1.0, 4.0, 0.0], [0.0, 1.0, 0.0]])
    # Request 0: drafts [1, 2] -> accepts 1, rejects 2 (argmax 0); request 1: [1] ok + bonus.
    drafts = torch.tensor([1, 2, -1, 1, -1])
    meta = SamplingMetadata.build([_Row(SamplingParams(temperature=0.0))] * 5,
                                  torch.device("cpu"), 3)
    out = rejection_sample(logits, drafts, torch.tensor([2, 1]), 2, meta)
    assert out.token_ids.tolist() == [[1, 0, PLACEHOLDER], [1, 1, PLACEHOLDER]]
    assert out.num_accepted.tolist() == [1, 1]


def test_seeded_requests_are_reproducible():
    logits = torch.randn(4 * 3, V)
    drafts = torch.tensor([0, 1, 2, -1] * 3)

    def run(seeds):
        rows = [_Row(SamplingParams(temperature=1.0, seed=s), s) for s in seeds]
        meta = SamplingMetadata.build([r for r in rows for _ in range(4)],
                                      torch.device("cpu"), V)
        return rejection_sample(logits, drafts, torch.tensor([3, 3, 3]), 3, meta).token_ids

    torch.manual_seed(0)
    a = run([11, 12, 13])
    torch.manual_seed(99)  # the global RNG does not matter to seeded rows
    b = run([11, 12, 13])
    assert torch.equal(a, b)
    assert not math.isnan(float(a.float().mean()))
