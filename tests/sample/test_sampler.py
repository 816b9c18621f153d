"""Sampler: greedy, seeded reproducibility, truncation sets, distribution, temperature."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sampler_helpers import CPU, Req, sample

from pagedllm.sample import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

V = 64


def rand_logits(n: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_argmax() -> None:
    logits = rand_logits(8)
    out = sample(logits, [Req(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_greedy_on_bf16_logits_is_the_fp32_argmax() -> None:
    """A plain greedy batch takes the argmax of bf16 logits as they are (no fp32 copy):
    the same tokens as the fp32 path, first index on ties; with logprobs asked, the
    logprobs are still computed in fp32."""
    logits = rand_logits(8, 512).to(torch.bfloat16)
    logits[3, 10] = logits[3, 400] = 30.0  # a tie: the first index wins
    greedy = [Req(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = sample(logits, greedy)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert int(out.sampled_token_ids[3]) == 10
    with_lp = sample(logits, [Req(SamplingParams(temperature=0.0, logprobs=2))
                              for _ in range(8)])
    assert torch.equal(with_lp.sampled_token_ids, out.sampled_token_ids)
    assert with_lp.logprobs is not None and with_lp.logprobs.logprobs.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(1, out.sampled_token_ids[:, None])
    assert torch.allclose(with_lp.logprobs.logprobs[:, :1], want)


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = rand_logits(6)
    reqs = [Req(SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5 if i % 2 == 0
                               else -1)) for i in range(6)]
    out = sample(logits, reqs)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def test_greedy_ignores_seed_and_truncation_knobs() -> None:
    logits = rand_logits(1)
    out = sample(logits, [Req(SamplingParams(temperature=0.0, seed=3, top_p=0.1))])
    assert int(out.sampled_token_ids[0]) == int(logits.argmax())


def test_input_logits_not_modified() -> None:
    logits = rand_logits(2)
    before = logits.clone()
    sample(logits, [Req(SamplingParams(top_k=3, top_p=0.5, min_p=0.1, presence_penalty=1.0,
                                       logit_bias={1: 5.0}), output_token_ids=[2]),
                    Req(SamplingParams(temperature=0.0, min_tokens=2), eos_token_id=0)])
    assert torch.equal(logits, before)


def _seeded_run(seed_params: SamplingParams, others: list[SamplingParams], position: int,
                steps: int = 5) -> list[int]:
    """Tokens the seeded request gets over ``steps`` steps when batched with ``others``."""
    target = Req(seed_params)
    companions = [Req(p) for p in others]
    got = []
    for step in range(steps):
        rows = list(companions)
        rows.insert(position, target)
        logits = rand_logits(len(rows), seed=100 + step)
        # The seeded row always sees the same logits; the others get whatever is there.
        logits[position] = rand_logits(1, seed=step)[0]
        got.append(int(sample(logits, rows).sampled_token_ids[position]))
    return got


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, seed=123),
    SamplingParams(temperature=0.0, seed=5),
])
def test_seeded_request_independent_of_batch(params: SamplingParams) -> None:
    alone = _seeded_run(params, [], 0)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3),
             SamplingParams(top_k=3, seed=99), SamplingParams(top_p=0.5, presence_penalty=1.0)]
    assert _seeded_run(params, mixed, 2) == alone
    assert _seeded_run(params, mixed[:1], 1) == alone
    assert _seeded_run(params, mixed * 3, 0) == alone
    assert _seeded_run(params, [SamplingParams(temperature=0.5)] * 7, 7) == alone


def test_same_seed_same_samples_different_seed_differs() -> None:
    logits = torch.zeros(4, 1000)  # uniform: any difference comes from the noise
    reqs = [Req(SamplingParams(seed=1)), Req(SamplingParams(seed=1)),
            Req(SamplingParams(seed=2)), Req(SamplingParams())]
    ids = sample(logits, reqs).sampled_token_ids
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


def test_unseeded_rows_use_global_rng() -> None:
    logits = torch.zeros(64, 1000)
    torch.manual_seed(0)
    a = sample(logits, [Req(SamplingParams()) for _ in range(64)]).sampled_token_ids
    torch.manual_seed(0)
    b = sample(logits, [Req(SamplingParams()) for _ in range(64)]).sampled_token_ids
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 30  # rows are independent draws


def test_exponential_race_matches_softmax_distribution() -> None:
    n = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -30.0]]).repeat(n, 1)
    torch.manual_seed(1)
    ids = sample(logits, [Req(SamplingParams(temperature=1.0))] * n).sampled_token_ids
    freq = torch.bincount(ids, minlength=6).double() / n
    probs = logits[0].double().softmax(-1)
    # 4 standard errors of a Bernoulli(p) mean over n draws.
    assert torch.all((freq - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt() + 1e-9)


def _entropy_of_samples(temperature: float) -> float:
    n = 20_000
    logits = rand_logits(1, v=32, seed=3).repeat(n, 1)
    torch.manual_seed(2)
    ids = sample(logits, [Req(SamplingParams(temperature=temperature))] * n).sampled_token_ids
    p = torch.bincount(ids, minlength=32).double() / n
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def test_temperature_raises_entropy() -> None:
    h = [_entropy_of_samples(t) for t in (0.25, 0.5, 1.0, 2.0, 8.0)]
    assert h == sorted(h)
    assert h[-1] > h[0] + 1.0
    assert h[-1] <= math.log(32) + 1e-9


# --- truncation: sampled tokens never leave the allowed set ------------------------------

logit_rows = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40)


def _allowed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Hand-written float64 reference: tokens every truncation rule allows."""
    x = logits.double() / p.temperature
    v = x.numel()
    ok = torch.ones(v, dtype=torch.bool)
    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, v) - 1]
        ok &= x >= kth
    # top-p: the mass of tokens strictly more likely than t (within top-k) is below p.
    # min-p: ratios to the max survive renormalisation, so they are judged on x itself.
    xk = torch.where(ok, x, torch.tensor(float("-inf"), dtype=torch.float64))
    probs = xk.softmax(-1)
    for t in range(v):
        above = float(probs[probs > probs[t]].sum())
        if above >= p.top_p + 1e-4:
            ok[t] = False
        if float(probs[t]) < p.min_p * float(probs.max()) * (1 - 1e-4):
            ok[t] = False
    return ok


@settings(max_examples=60, deadline=None)
@given(row=logit_rows, k=st.integers(1, 50), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 0.9), temperature=st.floats(0.2, 3.0),
       use=st.tuples(st.booleans(), st.booleans(), st.booleans()), seed=st.integers(0, 2**31))
def test_truncation_never_samples_outside_set(row: list[float], k: int, top_p: float,
                                              min_p: float, temperature: float,
                                              use: tuple[bool, bool, bool], seed: int) -> None:
    params = SamplingParams(temperature=temperature, top_k=k if use[0] else -1,
                            top_p=top_p if use[1] else 1.0, min_p=min_p if use[2] else 0.0)
    n = 300
    logits = torch.tensor([row], dtype=torch.float32).repeat(n, 1)
    torch.manual_seed(seed)
    ids = sample(logits, [Req(params)] * n).sampled_token_ids
    allowed = _allowed(logits[0], params)
    assert bool(allowed[ids].all()), (ids[~allowed[ids]], allowed)


@settings(max_examples=30, deadline=None)
@given(row=logit_rows, k=st.integers(1, 5))
@example(row=[0.0, 1.401298464324817e-45], k=1)
def test_top_k_set_is_exact_for_distinct_logits(row: list[float], k: int) -> None:
    x = torch.tensor(row)
    # Distinct *after* the temperature: 1.4e-45 / 50 rounds to 0.0 in fp32, and then two
    # "distinct" logits tie and either may be sampled (hypothesis found that row).
    scaled = x / 50.0
    if len(set(scaled.tolist())) != len(row) or k >= len(row):
        return
    n = 2000
    torch.manual_seed(0)
    ids = sample(x.repeat(n, 1), [Req(SamplingParams(top_k=k, temperature=50.0))] * n)
    top = set(scaled.topk(k).indices.tolist())
    assert set(ids.sampled_token_ids.tolist()) <= top


def test_top_p_keeps_argmax_even_when_tiny() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 5.0]]).repeat(200, 1)
    ids = sample(logits, [Req(SamplingParams(top_p=1e-3))] * 200).sampled_token_ids
    assert torch.all(ids == 3)


def test_mixed_top_k_rows_use_their_own_k() -> None:
    logits = torch.arange(10, dtype=torch.float32).repeat(3, 1) * 0.01  # nearly uniform
    reqs = [Req(SamplingParams(top_k=1)), Req(SamplingParams(top_k=3)), Req(SamplingParams())]
    seen: list[set[int]] = [set(), set(), set()]
    for s in range(300):
        torch.manual_seed(s)
        for i, t in enumerate(sample(logits, reqs).sampled_token_ids.tolist()):
            seen[i].add(t)
    assert seen[0] == {9}
    assert seen[1] == {7, 8, 9}
    assert len(seen[2]) == 10


def test_no_host_sync_in_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [Req(SamplingParams(top_k=4, top_p=0.8, min_p=0.1, logprobs=3, seed=1,
                               presence_penalty=0.5, frequency_penalty=0.5,
                               repetition_penalty=1.2, logit_bias={1: 2.0}, min_tokens=3),
                prompt_token_ids=[1, 2], output_token_ids=[3], eos_token_id=0),
            Req(SamplingParams(temperature=0.0, logprobs=1))]
    meta = SamplingMetadata.build(reqs, CPU, V)

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("host sync inside the sampler")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    Sampler()(rand_logits(2), meta)
