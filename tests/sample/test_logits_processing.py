"""Penalties, logit_bias, min_tokens, logprobs: exact values against per-token references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampler_helpers import CPU, Req, sample

from pagedllm.sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.sampling_params import SamplingParams

V = 16


def processed(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    meta = SamplingMetadata.build(reqs, CPU, logits.shape[-1])
    return Sampler.apply_logits_processors(logits.clone(), meta)


def reference(row: list[float], r: Req) -> list[float]:
    """The definitions, one token at a time, in vLLM's order."""
    p = r.params
    out = list(row)
    for t, b in (p.logit_bias or {}).items():
        if t < len(out):
            out[t] += b
    if len(r.output_token_ids) < p.min_tokens:
        for t in set(p.stop_token_ids or []) | ({r.eos_token_id} - {None}):
            out[t] = float("-inf")
    for t in range(len(out)):
        c = r.output_token_ids.count(t)
        if t in r.prompt_token_ids or c > 0:
            out[t] = (out[t] / p.repetition_penalty if out[t] > 0
                      else out[t] * p.repetition_penalty)
        out[t] -= p.frequency_penalty * c
        out[t] -= p.presence_penalty * (c > 0)
    return out


ids = st.lists(st.integers(0, V - 1), max_size=12)


@settings(max_examples=80, deadline=None)
@given(rep=st.floats(0.1, 3.0), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
       prompt=ids, output=ids,
       bias=st.dictionaries(st.integers(0, V + 3), st.floats(-100, 100), max_size=4),
       min_tokens=st.integers(0, 4), stops=st.lists(st.integers(0, V - 1), max_size=2),
       seed=st.integers(0, 1000))
def test_processing_matches_reference(rep: float, freq: float, pres: float, prompt: list[int],
                                      output: list[int], bias: dict[int, float],
                                      min_tokens: int, stops: list[int], seed: int) -> None:
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres, logit_bias=bias, min_tokens=min_tokens,
                            stop_token_ids=stops, max_tokens=20)
    target = Req(params, prompt_token_ids=prompt, output_token_ids=output, eos_token_id=1)
    plain = Req(SamplingParams(), prompt_token_ids=[1, 2], output_token_ids=[3])
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 4
    got = processed(logits, [plain, target, plain])
    want = torch.tensor(reference(logits[1].tolist(), target))
    torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-5)
    # Rows without any processing are untouched.
    assert torch.equal(got[0], logits[0])
    assert torch.equal(got[2], logits[2])


def test_each_penalty_alone() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    prompt, output = [0], [1, 1, 2]

    def run(**kw: float) -> list[float]:
        r = Req(SamplingParams(**kw), prompt_token_ids=prompt, output_token_ids=output)
        return processed(logits, [r])[0].tolist()

    assert run(repetition_penalty=2.0) == [1.0, -4.0, 0.5, 0.5]
    assert run(frequency_penalty=0.5) == [2.0, -3.0, 0.5, 0.5]
    assert run(presence_penalty=0.5) == [2.0, -2.5, 0.5, 0.5]
    assert run(presence_penalty=-1.0) == [2.0, -1.0, 2.0, 0.5]


def test_logit_bias_exact_and_out_of_vocab_ignored() -> None:
    logits = torch.zeros(2, V)
    r = Req(SamplingParams(logit_bias={3: 7.5, 5: -100.0, V + 10: 4.0}))
    got = processed(logits, [Req(SamplingParams()), r])
    want = torch.zeros(V)
    want[3], want[5] = 7.5, -100.0
    assert torch.equal(got[1], want)
    assert torch.equal(got[0], torch.zeros(V))


def test_logit_bias_steers_greedy() -> None:
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0
    out = sample(logits, [Req(SamplingParams(temperature=0.0, logit_bias={9: 20.0}))])
    assert int(out.sampled_token_ids[0]) == 9


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    logits = torch.zeros(1, V)
    logits[0, 0] = 50.0  # EOS is overwhelmingly likely
    logits[0, 4] = 49.0  # then the stop token
    params = SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=ignore_eos)
    for n_out in range(3):
        r = Req(params, output_token_ids=[7] * n_out, eos_token_id=0)
        got = processed(logits, [r])[0]
        assert got[0] == float("-inf") and got[4] == float("-inf")
        assert torch.isfinite(got[torch.arange(V) % 4 != 0]).all()
        for _ in range(20):
            assert int(sample(logits, [r]).sampled_token_ids[0]) not in (0, 4)
    r = Req(params, output_token_ids=[7] * 3, eos_token_id=0)
    assert torch.equal(processed(logits, [r])[0], logits[0])


def test_min_tokens_with_no_eos_and_out_of_range_stop() -> None:
    r = Req(SamplingParams(min_tokens=2, stop_token_ids=[V + 5]), eos_token_id=None)
    meta = SamplingMetadata.build([r], CPU, V)
    assert meta.min_tokens_mask is None


# --- logprobs ---------------------------------------------------------------------------

def test_logprobs_columns_and_ranks_match_log_softmax() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [Req(SamplingParams(logprobs=3, seed=i, temperature=2.0,
                               presence_penalty=2.0), output_token_ids=[1, 2])
            for i in range(3)]
    reqs.append(Req(SamplingParams(temperature=0.0, logprobs=0)))
    out = sample(logits, reqs)
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    ref = logits.log_softmax(-1)  # raw: before penalties and temperature
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled[:, None])[:, 0])
    top = ref.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    order = ref.argsort(dim=-1, descending=True)
    for i in range(4):
        want_rank = int((order[i] == sampled[i]).nonzero()) + 1
        assert int(lp.ranks[i]) == want_rank
    assert int(lp.ranks[3]) == 1  # greedy row took the raw argmax (no penalties there)


def test_logprobs_zero_gives_only_sampled_column() -> None:
    out = sample(torch.randn(2, V), [Req(SamplingParams(logprobs=0))] * 2)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, 1)


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([3, 0, 15, 7, 7])
    lp = compute_prompt_logprobs(logits, targets, 2)
    ref = logits.log_softmax(-1)
    assert torch.equal(lp.token_ids[:, 0], targets)
    torch.testing.assert_close(lp.logprobs[:, 0], ref[torch.arange(5), targets])
    assert torch.equal(lp.token_ids[:, 1:], ref.topk(2).indices)
    want = (ref >= ref[torch.arange(5), targets][:, None]).sum(-1)
    assert torch.equal(lp.ranks, want)
    ids, vals, ranks = lp.tolists()
    assert len(ids) == 5 and len(ids[0]) == 3 and isinstance(ranks[0], int)
