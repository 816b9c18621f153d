"""The CPU backend's C decode step (``attention/cpu_decode.py``) against the torch reference.

Random caches and shuffled block tables; one new token per request (1 to 5 requests,
contexts 0 to 80 tokens, block size 16); GQA ratios 1/3/4; head dims 64 and 128 (the
register paths) and 48 (the generic loop); full and partial rotary; sliding windows and
logit soft-caps.  The reference is ``TorchReferenceBackend.forward_rope`` on copies of the
same inputs: the rotated queries and the cache it writes must be bit-identical, the
attention output equal to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import cpu_decode as decode_attention
from pagedllm.attention.cpu_backend import CpuBackend
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.rope import RopeInputs
from pagedllm.attention.torch_ref import TorchReferenceBackend
from tests.models.paged import build_metadata, positions_for

pytestmark = pytest.mark.skipif(decode_attention._lib() is None,
                                reason="no C compiler: the torch path runs instead")

BS = 16


def _case(ctx: list[int], hq: int, hk: int, d: int, rot: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    need = [c // BS + 1 for c in ctx]
    perm = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in need]
    cache = torch.randn(2, sum(need) + 3, BS, hk, d, generator=g)
    meta = build_metadata(ctx, [1] * len(ctx), tables, BS)
    t = len(ctx)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)  # views, as the model hands them
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cos_sin = torch.randn(256, rot, generator=g)
    rope = RopeInputs(positions_for(ctx, [1] * len(ctx)), cos_sin, torch.float32)
    return q, k, v, cache, meta, rope


def _both(ctx, hq, hk, d, rot, kind, seed=0):
    q, k, v, cache, meta, rope = _case(ctx, hq, hk, d, rot, seed)
    assert decode_attention.applies(q, k, v, cache, meta)
    ref_q, ref_cache = q.clone(), cache.clone()
    ref = TorchReferenceBackend().forward_rope(ref_q, k.clone(), v.clone(), ref_cache, meta,
                                               d ** -0.5, rope, kind)
    out = CpuBackend().forward_rope(q, k, v, cache, meta, d ** -0.5, rope, kind)
    return out, ref, cache, ref_cache


@pytest.mark.parametrize("hq,hk", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("d", [64, 128, 48])
def test_matches_torch_reference(hq: int, hk: int, d: int) -> None:
    for seed, ctx in enumerate([[0], [37], [5, 80, 16, 0, 31]]):
        out, ref, cache, ref_cache = _both(ctx, hq, hk, d, d, FULL, seed)
        assert torch.equal(cache, ref_cache)  # rotated keys and values, bit for bit
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [AttentionKind(sliding_window=8),
                                  AttentionKind(logits_soft_cap=5.0),
                                  AttentionKind(sliding_window=20, logits_soft_cap=30.0)],
                         ids=lambda k: k.describe())
def test_windows_softcaps_and_partial_rotary(kind: AttentionKind) -> None:
    for rot in (64, 32):
        out, ref, cache, ref_cache = _both([3, 45, 17], 6, 2, 64, rot, kind, seed=rot)
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_unwritten_slot_and_other_steps_fall_back() -> None:
    q, k, v, cache, meta, rope = _case([10, 20], 4, 2, 64, 64, seed=3)
    meta.slot_mapping[1] = -1  # a token whose KV must not be written
    ref_cache = cache.clone()
    ref = TorchReferenceBackend().forward_rope(q.clone(), k.clone(), v.clone(), ref_cache,
                                               meta, 0.125, rope)
    out = CpuBackend().forward_rope(q, k, v, cache, meta, 0.125, rope)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # A prompt step, bf16 activations and an fp8 cache are the reference's.
    prompt = build_metadata([0], [3], [[1]], BS)
    assert not decode_attention.applies(q[:3], k[:3], v[:3], cache, prompt)
    assert not decode_attention.applies(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                        cache.bfloat16(), meta)
    assert not decode_attention.applies(q, k, v, cache.to(torch.float8_e4m3fn), meta)


def _mixed_case(seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    hq, hk, d = 6, 2, 64
    ctx, qlens = [37, 0, 16, 20], [1, 5, 1, 3]
    need = [(c + n) // BS + 1 for c, n in zip(ctx, qlens)]
    perm = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in need]
    cache = torch.randn(2, sum(need) + 3, BS, hk, d, generator=g)
    t = sum(qlens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cos_sin = torch.randn(256, d, generator=g)
    return ctx, qlens, tables, cache, q, k, v, cos_sin, d


def _run(q, k, v, cache, ctx, qlens, tables, cos_sin, d):  # type: ignore[no-untyped-def]
    meta = build_metadata(ctx, qlens, tables, BS)
    rope = RopeInputs(positions_for(ctx, qlens), cos_sin, torch.float32)
    return CpuBackend().forward_rope(q.clone(), k.clone(), v.clone(), cache, meta,
                                     d ** -0.5, rope)


def test_every_row_is_batch_invariant() -> None:
    """A step mixing prompt chunks with one-token requests: every row, prompt or decode,
    is bit for bit what it gets with its request alone, with its prompt split into other
    chunks, or computed one token at a time as decodes (``cpu_backend.py``'s contract);
    the cache is the reference's bit for bit and the outputs equal the reference's to
    float32 rounding."""
    ctx, qlens, tables, cache, q, k, v, cos_sin, d = _mixed_case()
    mixed = build_metadata(ctx, qlens, tables, BS)
    rope = RopeInputs(positions_for(ctx, qlens), cos_sin, torch.float32)
    ref_cache = cache.clone()
    ref = TorchReferenceBackend().forward_rope(q.clone(), k.clone(), v.clone(), ref_cache,
                                               mixed, d ** -0.5, rope)
    got_cache = cache.clone()
    got = _run(q, k, v, got_cache, ctx, qlens, tables, cos_sin, d)
    assert torch.equal(got_cache, ref_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    starts = [sum(qlens[:i]) for i in range(len(qlens))]
    for r, (c, n, s) in enumerate(zip(ctx, qlens, starts)):
        rows = slice(s, s + n)
        alone = _run(q[rows], k[rows], v[rows], cache.clone(), [c], [n], [tables[r]],
                     cos_sin, d)
        assert torch.equal(alone, got[rows]), r
        # One token at a time (each a decode step over the keys written before it).
        step_cache = cache.clone()
        for i in range(n):
            one = slice(s + i, s + i + 1)
            out = _run(q[one], k[one], v[one], step_cache, [c + i], [1], [tables[r]],
                       cos_sin, d)
            assert torch.equal(out, got[one]), (r, i)
    # The 5-token prompt (request 1) as chunks of 2 and 3 beside other requests.
    chunk_cache = cache.clone()
    first = _run(q[1:3], k[1:3], v[1:3], chunk_cache, [0], [2], [tables[1]], cos_sin, d)
    rest = torch.cat([q[6:7], q[3:6]]), torch.cat([k[6:7], k[3:6]]), torch.cat([v[6:7],
                                                                                   v[3:6]])
    second = _run(*rest, chunk_cache, [ctx[2], 2], [1, 3], [tables[2], tables[1]],
                  cos_sin, d)
    assert torch.equal(torch.cat([first, second[1:]]), got[1:6])
    assert torch.equal(second[:1], got[6:7])
