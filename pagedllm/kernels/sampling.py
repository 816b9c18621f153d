"""GPU sampling with no host sync: greedy, temperature, top-k, top-p, min-p, and a
counter-based RNG so a seeded row is reproducible whatever else is in the batch.

How a token is drawn (the "exponential race", as in ``pagedllm.sample.sampler``)::

    keep_j   = x_j >= threshold            (top-k / top-p / min-p folded into one
                                            per-row logit threshold, see below)
    u_j      = philox(seed, counter = (step << 32) | j)     uniform in (0, 1)
    token    = argmax_j over kept j of  x_j / T - log(-log u_j)

``-log u`` is Exp(1), so ``argmax p_j / q_j`` picks ``j`` with probability ``p_j``
(Gumbel-max) -- no softmax, no cumulative sum, and one pass over the logits.  The noise of
token ``j`` depends only on (row seed, row step, ``j``): a row with the same seed, step
and logits samples the same token in any batch, at any row index, with or without
truncation of other rows.  Callers give every random row a seed; for requests without a
user seed the runner draws one at admission (e.g. from ``random.getrandbits(63)``) and
advances ``step`` by one per sampled token.

Truncation as a logit threshold (ties at the boundary are all kept):

* top-k: the k-th largest logit (``torch.topk`` of the batch's max k, or the sort below);
* top-p: the smallest logit of the most-likely-first prefix whose probability (after
  top-k, at temperature T) reaches p -- needs one descending ``torch.sort``;
* min-p: ``max_logit + T * log(min_p)`` (p_j >= min_p * p_max);

thresholds combine with ``max``.  All of it is device work: the only host inputs are
``max_top_k`` and which features are present, which the runner knows from the requests.

Grid: (rows, vocab chunks); each program writes its chunk's best (score, index) and a
tiny torch argmax picks the winner (the first on ties, like ``torch.argmax``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest fp32 below 1: Triton's uniform can round to exactly 1.0, and -log(-log 1) = inf
# would make that token win unconditionally.
_U_MAX = tl.constexpr(0.99999994)  # a global a Triton kernel reads must be constexpr


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, stride_l, thr_ptr, temp_ptr, greedy_ptr, seed_ptr, step_ptr,
    best_val_ptr, best_idx_ptr, vocab, num_chunks,
    ALL_GREEDY: tl.constexpr, HAS_GREEDY_MASK: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    score = x
    if not ALL_GREEDY:
        temp = tl.load(temp_ptr + row)
        greedy = temp <= 0.0
        if HAS_GREEDY_MASK:
            greedy = greedy | (tl.load(greedy_ptr + row) != 0)
        if not greedy:
            seed = tl.load(seed_ptr + row)
            step = tl.load(step_ptr + row).to(tl.int64)
            u = tl.rand(seed, (step << 32) + cols.to(tl.int64))
            u = tl.minimum(u, _U_MAX)
            gumbel = -tl.log(-tl.log(u))
            score = tl.div_rn(x, temp) + gumbel
            if HAS_THRESHOLD:
                thr = tl.load(thr_ptr + row)
                score = tl.where(x >= thr, score, float("-inf"))
            score = tl.where(valid, score, float("-inf"))
    best = tl.max(score, 0)
    idx = tl.argmax(score, 0)  # first maximum on ties
    out = row * num_chunks + chunk
    tl.store(best_val_ptr + out, best)
    tl.store(best_idx_ptr + out, chunk * BLOCK + idx)


def truncation_threshold(
    logits: torch.Tensor, temperature: torch.Tensor, *, top_k: torch.Tensor | None = None,
    max_top_k: int | None = None, top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Per-row raw-logit threshold ``[N]`` fp32 (keep ``x >= thr``), or None if no
    truncation is asked.  ``top_k`` rows with k >= V (or k <= 0) are unrestricted;
    ``top_p`` 1.0 and ``min_p`` 0.0 mean off.  Pure device ops, no host sync.

    The threshold is on the *raw* logits (not ``x / T``) so the kernel's comparison is
    exact; temperature only enters top-p's and min-p's probabilities.
    """
    if top_k is None and top_p is None and min_p is None:
        return None
    x = logits.float()
    vocab = x.shape[-1]
    temp = temperature.float().clamp_min(1e-6).unsqueeze(1)
    neg_inf = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
    thr = neg_inf
    k = None
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    if top_p is not None:
        sorted_x = x.sort(dim=-1, descending=True).values
        keep = torch.ones_like(sorted_x, dtype=torch.bool)
        if k is not None:
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            keep = sorted_x >= kth
        probs = (sorted_x / temp).masked_fill(~keep, float("-inf")).softmax(-1)
        exclusive = probs.cumsum(-1) - probs
        # top_p 1.0 means "off": fp32 cumsum can reach 1.0 before the last token.
        p_row = top_p.float().unsqueeze(1)
        keep &= (exclusive < p_row) | (p_row >= 1.0)
        keep[:, 0] = True  # the most likely token always survives
        n_keep = keep.sum(-1, keepdim=True)  # keep is a prefix of the sorted row
        thr = sorted_x.gather(1, n_keep - 1)
    elif k is not None:
        kk = vocab if max_top_k is None else max(1, min(int(max_top_k), vocab))
        vals = x.topk(kk, dim=-1).values
        kth = vals.gather(1, (k.clamp(max=kk) - 1).unsqueeze(1))
        thr = torch.where((k >= vocab).unsqueeze(1), neg_inf, kth)
    if min_p is not None:
        row_max = x.amax(-1, keepdim=True)
        thr = torch.maximum(thr, row_max + temp * torch.log(min_p.float().unsqueeze(1)))
    return thr.squeeze(1).contiguous()


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor | None,
    seeds: torch.Tensor | None = None, steps: torch.Tensor | None = None, *,
    greedy_mask: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
    max_top_k: int | None = None, top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None, block: int = 4096,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, V]`` (any float dtype; not modified).

    Args:
      temperature: ``[N]`` fp32, or None when every row is greedy.  Rows with
        ``temperature <= 0`` (or ``greedy_mask`` True) take the argmax.
      seeds, steps: ``[N]`` int64 per-row RNG key (required unless all greedy); the
        draw for a row depends only on (seed, step, its logits).
      top_k (int, k >= V or <= 0 = off), max_top_k (host int: the largest k in use,
        sizes ``torch.topk``), top_p, min_p: ``[N]`` per-row truncation, None = unused.
      block: vocab chunk per program (tests use small values to cover the merge).

    Returns ``[N]`` int64 on the logits' device.  Never syncs with the host.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1
    n, vocab = logits.shape
    device = logits.device
    all_greedy = temperature is None
    thr = None
    if not all_greedy:
        assert seeds is not None and steps is not None, "random rows need seeds and steps"
        assert temperature is not None
        thr = truncation_threshold(logits, temperature, top_k=top_k, max_top_k=max_top_k,
                                   top_p=top_p, min_p=min_p)
    block = min(block, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, block)
    best_val = torch.empty((n, num_chunks), dtype=torch.float32, device=device)
    best_idx = torch.empty((n, num_chunks), dtype=torch.int64, device=device)
    if n == 0:
        return torch.empty((0,), dtype=torch.int64, device=device)
    dummy = best_val  # placeholder pointer for arguments a constexpr switches off
    _sample_chunk_kernel[(n, num_chunks)](
        logits, logits.stride(0), thr if thr is not None else dummy,
        temperature if temperature is not None else dummy,
        greedy_mask if greedy_mask is not None else dummy,
        seeds if seeds is not None else dummy, steps if steps is not None else dummy,
        best_val, best_idx, vocab, num_chunks,
        ALL_GREEDY=all_greedy, HAS_GREEDY_MASK=greedy_mask is not None,
        HAS_THRESHOLD=thr is not None, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    if num_chunks == 1:
        return best_idx.view(n)
    # torch.argmax returns the first maximum, so ties resolve to the lowest chunk.
    winner = best_val.argmax(dim=1, keepdim=True)
    return best_idx.gather(1, winner).view(n)
