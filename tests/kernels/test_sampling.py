"""GPU sampling kernel: greedy = argmax, the draw follows softmax(x / T), truncation keeps
exactly the set the torch sampler keeps, and a seeded row is reproducible regardless of
its batch."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.sampling import sample_tokens, truncation_threshold
from pagedllm.sample.sampler import apply_min_p, apply_top_k_top_p


def _rows(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float32, device=DEVICE)


def test_greedy_matches_argmax() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 300, generator=gen).to(DEVICE, torch.bfloat16)
    logits[2, 17] = logits[2, 200] = 50.0  # tie: the first index wins, like torch.argmax
    want = logits.float().argmax(-1)
    assert torch.equal(sample_tokens(logits, None, block=64), want), f"seed={seed}"
    # Mixed batch: temperature 0 rows and greedy_mask rows take the argmax too.
    temp = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0], device=DEVICE)
    mask = torch.tensor([False, True, False, False, False], device=DEVICE)
    seeds = torch.arange(5, device=DEVICE, dtype=torch.int64)
    got = sample_tokens(logits, temp, seeds, torch.zeros_like(seeds), greedy_mask=mask,
                        block=64)
    for r in (0, 1, 4):
        assert got[r] == want[r]


def test_distribution_follows_softmax() -> None:
    """Many rows of the same logits with distinct seeds: frequencies ~ softmax(x/T).

    Each row is one interpreter program (~30-60 ms), so the CPU run uses few samples and
    logits whose distribution at T=0.5 is far (> 5 sd) from the one at T=1 and from
    uniform; the GPU run uses 20k samples (and test_gpu_distribution_big_vocab more).

    Each token's count must lie inside its exact binomial acceptance region (both tails
    above 1e-7), so a correct sampler fails < 1e-6 of runs: the former normal bound,
    4.5 sd + 1e-3, rejected a correct sampler in ~3.5e-4 of runs (the rarest token,
    p = 0.002, expects 0.55 hits of 256 and 5 hits were rejected), and a T = 1 sampler
    still passes < 1e-3 of CPU runs."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    base, temp = torch.tensor([0.0, 1.0, 2.0, -1.0]), 0.5
    n = 20000 if ON_GPU else 256
    logits = base.expand(n, 4).contiguous().to(DEVICE)
    seeds = torch.randint(0, 2**62, (n,), generator=gen).to(DEVICE)
    steps = torch.randint(0, 2**31, (n,), generator=gen).to(DEVICE)
    toks = sample_tokens(logits, _rows(n, temp), seeds, steps)
    counts = torch.bincount(toks.cpu(), minlength=4)
    probs = (base / temp).softmax(-1)
    lower, upper = _binomial_tails(counts, n, probs)
    assert ((lower > 1e-7) & (upper > 1e-7)).all(), (counts / n, probs, lower, upper, seed)


def _binomial_tails(counts: torch.Tensor, n: int, probs: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact P(X <= count) and P(X >= count) for X ~ Binomial(n, p), per token."""
    k = torch.arange(n + 1, dtype=torch.float64)
    pmf = torch.distributions.Binomial(n, probs=probs.double()[:, None]).log_prob(k).exp()
    idx = counts.long()[:, None]
    lower = pmf.cumsum(-1).gather(1, idx)[:, 0]
    upper = pmf.flip(-1).cumsum(-1).flip(-1).gather(1, idx)[:, 0]
    return lower, upper


def test_seeded_rows_reproducible_across_batches() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    v = 100
    row = torch.randn(v, generator=gen) * 0.5  # flat: consecutive steps must differ
    others = torch.randn(6, v, generator=gen)
    batch_a = torch.cat([row[None], others[:3]]).to(DEVICE)
    batch_b = torch.cat([others[3:], row[None]]).to(DEVICE)
    seeds_a = torch.tensor([1234, 5, 6, 7], device=DEVICE)
    seeds_b = torch.tensor([8, 9, 10, 1234], device=DEVICE)
    got_a, got_b = [], []
    for step in range(8):
        steps = torch.full((4,), step, dtype=torch.int64, device=DEVICE)
        # batch b also truncates its other rows: must not change row 3's draw
        tk = torch.tensor([5, 3, 0, 0], device=DEVICE)
        got_a.append(int(sample_tokens(batch_a, _rows(4, 1.0), seeds_a, steps, block=64)[0]))
        got_b.append(int(sample_tokens(batch_b, _rows(4, 1.0), seeds_b, steps, top_k=tk,
                                       max_top_k=5, block=128)[3]))
    assert got_a == got_b, f"seed={seed}"
    assert len(set(got_a)) > 1, "steps must advance the random stream"


def _kept_by_torch(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor | None,
                   max_top_k: int, top_p: torch.Tensor | None,
                   min_p: torch.Tensor | None) -> torch.Tensor:
    y = apply_top_k_top_p(x / temp[:, None], top_k, max_top_k, top_p)
    if min_p is not None:
        y = apply_min_p(y, min_p)
    return torch.isfinite(y)


@pytest.mark.parametrize("mode", ["top_k", "top_p", "both", "min_p"])
def test_truncation_matches_torch_sampler(mode: str) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, v = 6, 64
    x = (torch.randn(n, v, generator=gen) * 2).to(DEVICE)
    temp = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    top_k = top_p = min_p = None
    if mode in ("top_k", "both"):
        top_k = torch.tensor([1, 5, v, 20, 3, v], device=DEVICE)
    if mode in ("top_p", "both"):
        top_p = torch.tensor([0.5, 0.9, 0.3, 1.0, 0.95, 0.05], device=DEVICE)
    if mode == "min_p":
        min_p = torch.tensor([0.0, 0.1, 0.5, 0.01, 0.9, 0.2], device=DEVICE)
    thr = truncation_threshold(x, temp, top_k=top_k, max_top_k=20, top_p=top_p,
                               min_p=min_p)
    assert thr is not None
    want = _kept_by_torch(x, temp, top_k, 20, top_p, min_p)
    got = x >= thr[:, None]
    assert torch.equal(got, want), f"seed={seed}"
    # Every draw lands in the kept set; k = 1 rows are the argmax.
    seeds = torch.randint(0, 2**40, (n,), generator=gen).to(DEVICE)
    for step in range(2):
        toks = sample_tokens(x, temp, seeds, torch.full_like(seeds, step), top_k=top_k,
                             max_top_k=20, top_p=top_p, min_p=min_p, block=16)
        assert want.gather(1, toks[:, None]).all(), f"seed={seed}"
        if top_k is not None:
            assert toks[0] == x[0].argmax()


@pytest.mark.gpu
def test_gpu_no_host_sync_llama_vocab() -> None:
    """Real vocab (128256), batch 256, every feature on, under sync-debug 'error'."""
    n, v = 256, 128256
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    temp = torch.rand(n, device="cuda") + 0.1
    temp[::4] = 0.0
    seeds = torch.randint(0, 2**62, (n,), device="cuda")
    steps = torch.randint(0, 1000, (n,), device="cuda")
    top_k = torch.randint(1, 100, (n,), device="cuda")
    top_p = torch.rand(n, device="cuda") * 0.5 + 0.5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        toks = sample_tokens(logits, temp, seeds, steps, top_k=top_k, max_top_k=100,
                             top_p=top_p)
        toks2 = sample_tokens(logits, temp, seeds, steps, top_k=top_k, max_top_k=100)
        greedy = sample_tokens(logits, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(greedy, logits.float().argmax(-1))
    assert torch.equal(toks[::4], greedy[::4]) and torch.equal(toks2[::4], greedy[::4])
    x = logits.float()
    kept = _kept_by_torch(x, temp.clamp_min(1e-6), top_k, 100, top_p, None)
    # bf16 logits over a 128k vocabulary tie often; the kernel keeps every token tied
    # with the last one kept (its threshold is a logit value), the torch sampler only
    # those its sort put first.  So: the sampled logit is >= the smallest kept logit.
    floor = torch.where(kept, x, float("inf")).amin(-1)
    assert (x.gather(1, toks[:, None]).squeeze(1) >= floor).all()


@pytest.mark.skipif(not ON_GPU, reason="timing-free smoke of a big vocab on GPU only")
def test_gpu_distribution_big_vocab() -> None:
    v, n = 1000, 20000
    base = torch.randn(v) * 2
    logits = base.expand(n, v).contiguous().cuda()
    seeds = torch.arange(n, device="cuda")
    toks = sample_tokens(logits, _rows(n, 1.0), seeds, torch.zeros_like(seeds), block=256)
    freq = torch.bincount(toks.cpu(), minlength=v).float() / n
    probs = base.softmax(-1)
    assert (freq - probs).abs().max() < 0.02
