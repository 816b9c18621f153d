"""FP8 KV cache (attention/kv_cache_dtype.py): the Triton KV writes (plain and fused with
rotary) quantise exactly as the torch reference does, and the Triton paged attention over
an fp8 cache matches the reference backend reading the same cache -- split-KV, mixed
batches and non-unit scales included.  Under TRITON_INTERPRET=1 on the CPU, at real
shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, assert_close, fresh_seed, make_paged_batch

from pagedllm.attention.kv_cache_dtype import FP8_KV_DTYPE, check_backend, quantize_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.kv_write import write_kv_cache
from pagedllm.kernels.rotary import apply_rotary, rotary_and_write_kv


def _meta(batch, n: int) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping, query_start_loc_cpu=batch.query_start_loc.cpu(),
        seq_lens_cpu=batch.seq_lens.cpu(), block_size=batch.kv_cache.shape[2])


def _batch(q_lens, ctx_lens, dtype, gen, heads=(8, 2), head_dim=64, block_size=16):
    b = make_paged_batch(q_lens, ctx_lens, num_heads=heads[0], num_kv_heads=heads[1],
                         head_dim=head_dim, block_size=block_size, dtype=dtype,
                         device=DEVICE, pad_tokens=2, gen=gen)
    # Large values too, so saturation (|x| / scale > 448) is exercised.
    b.key[:, 0, :4] *= 800.0
    return b


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
def test_kv_write_matches_reference(scales: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    batch = _batch([1, 7, 3], [5, 0, 20], torch.bfloat16, gen)
    n = batch.key.shape[0] - 2
    ref = torch.zeros(batch.kv_cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    got = ref.clone()
    TorchReferenceBackend().write_kv(batch.key, batch.value, ref, _meta(batch, n), *scales)
    write_kv_cache(batch.key, batch.value, got, batch.slot_mapping, *scales)
    assert torch.equal(got.float(), ref.float())  # (the interpreter may turn -0 into +0)
    slots = batch.slot_mapping[:n]
    stored = ref.view(2, -1, *ref.shape[3:])[0, slots].float()
    torch.testing.assert_close(stored, quantize_kv(batch.key[:n], scales[0]).float())
    assert stored.abs().max() == 448.0  # saturated, not inf/NaN


def test_rotary_kv_write_matches_unfused() -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    batch = _batch([4, 1], [0, 9], torch.bfloat16, gen)
    t = batch.key.shape[0]
    pos = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    f = torch.arange(64, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([f.cos(), f.sin()], -1).to(DEVICE)
    q1, k1 = batch.query.clone(), batch.key.clone()
    apply_rotary(pos, q1, k1, 64, cos_sin)
    ref = torch.zeros(batch.kv_cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    write_kv_cache(k1, batch.value, ref, batch.slot_mapping, 0.5, 2.0)
    got = torch.zeros_like(ref)
    q2 = batch.query.clone()
    rotary_and_write_kv(pos, q2, batch.key.clone(), batch.value, 64, cos_sin, got,
                        batch.slot_mapping, k_scale=0.5, v_scale=2.0)
    assert torch.equal(q1, q2)
    assert torch.equal(got.float(), ref.float())


@pytest.mark.parametrize("case", ["decode", "split", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_fp8_cache(case: str, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = {"decode": ([1, 1, 1], [40, 3, 70]),
                        "split": ([1, 1], [90, 33]),
                        "mixed": ([1, 6, 1, 9], [33, 17, 2, 0])}[case]
    batch = _batch(q_lens, ctx_lens, dtype, gen)
    n = sum(q_lens)
    meta = _meta(batch, n)
    ks, vs = 0.02, 0.5
    cache = torch.zeros(batch.kv_cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    # The cached context, quantised by the reference; the new tokens are written by
    # each backend's own forward.
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    qc = cache.view(2, -1, *cache.shape[3:])
    qc[0] = quantize_kv(flat[0], ks)
    qc[1] = quantize_kv(flat[1], vs)
    qc[:, batch.slot_mapping[:n]] = torch.zeros((), dtype=FP8_KV_DTYPE, device=DEVICE)
    ref_cache = cache.clone()
    splits = 4 if case == "split" else None
    out = TritonAttentionBackend(force_num_splits=splits).forward(
        batch.query, batch.key, batch.value, cache, meta, 0.125, k_scale=ks, v_scale=vs)
    ref = TorchReferenceBackend().forward(batch.query, batch.key, batch.value, ref_cache,
                                          meta, 0.125, k_scale=ks, v_scale=vs)
    assert torch.equal(cache.float(), ref_cache.float())
    assert_close(out[:n], ref[:n], dtype, seed, scale=2.0)


def test_reference_round_trip_equals_dequantised_cache() -> None:
    """The reference over an fp8 cache equals the reference over a float cache holding
    the dequantised values: fp8 only changes what is stored."""
    gen = torch.Generator().manual_seed(fresh_seed())
    batch = _batch([1, 5], [20, 7], torch.float32, gen)
    batch.kv_cache = batch.kv_cache.cpu()
    n = 6
    meta = _meta(batch, n)
    q, k, v = batch.query.cpu(), batch.key.cpu(), batch.value.cpu()
    meta = AttentionMetadata(**{f: (getattr(meta, f).cpu() if torch.is_tensor(
        getattr(meta, f)) else getattr(meta, f)) for f in meta.__dataclass_fields__})
    fp8 = torch.zeros(batch.kv_cache.shape, dtype=FP8_KV_DTYPE)
    out = TorchReferenceBackend().forward(q, k, v, fp8, meta, 0.125, k_scale=0.1, v_scale=0.2)
    deq = torch.stack([fp8[0].float() * 0.1, fp8[1].float() * 0.2])
    again = TorchReferenceBackend().attend(q, deq, meta, 0.125)
    torch.testing.assert_close(out[:n], again[:n], rtol=0, atol=0)


def test_backend_without_fp8_is_refused() -> None:
    class BF16Only(TorchReferenceBackend):
        name = "bf16-only"
        kv_cache_dtypes = ("auto",)

    check_backend(TorchReferenceBackend(), "fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported by the "
                                         r"bf16-only attention backend; supported: auto"):
        check_backend(BF16Only(), "fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need a GPU")
def test_fp8_cache_llama3_shape_gpu() -> None:
    """Llama-3-8B attention shape (32 q / 8 kv heads, 128 dims), long contexts."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [1] * 24 + [200, 57], [int(x) for x in torch.randint(
        1, 3000, (26,), generator=gen)]
    batch = _batch(q_lens, ctx_lens, torch.bfloat16, gen, heads=(32, 8), head_dim=128)
    n = sum(q_lens)
    meta = _meta(batch, n)
    cache = torch.zeros(batch.kv_cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    ref_cache = cache.clone()
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, cache,
                                           meta, 0.088, k_scale=0.3, v_scale=0.7)
    # The reference in fp32 over the same cache (the bf16 inputs are exact in fp32, so
    # it stores the same e4m3 values): a bf16 reference's own roundings over contexts of
    # up to 3,000 tokens took it 0.05-0.08 away from the kernel (H200, 2026-12-03).
    ref = TorchReferenceBackend().forward(batch.query.float(), batch.key.float(),
                                          batch.value.float(), ref_cache, meta, 0.088,
                                          k_scale=0.3, v_scale=0.7)
    # Bitwise: both round the IEEE quotient x / scale half-to-even (quantize_kv divides by
    # a device tensor; the Triton write by tl.div_rn).  A run on 2026-12-02 saw 7 of
    # ~1.6M elements differ, all torch's +-2^-6 against Triton's +-7 * 2^-9, while the
    # reference still divided by a host float, which CUDA torch multiplies by the
    # reciprocal (one ulp off at times).  A failure lists each mismatch with x / scale.
    bad = (cache.view(torch.uint8) != ref_cache.view(torch.uint8)).nonzero()
    if len(bad):
        idx = [tuple(i) for i in bad[:6].tolist()]
        flat = torch.stack([batch.key, batch.value]).float().cpu()
        slot_of = {int(s): t for t, s in enumerate(batch.slot_mapping[:n].tolist())}
        rows = []
        for kv, blk, off, h, d in idx:
            t = slot_of.get(blk * cache.shape[2] + off)
            x = None if t is None else float(flat[kv, t, h, d])
            rows.append((float(ref_cache[kv, blk, off, h, d]), float(cache[kv, blk, off, h, d]),
                         x, None if x is None else x / (0.3, 0.7)[kv]))
        raise AssertionError(f"{len(bad)} fp8 KV elements differ (reference, triton, x, "
                             f"x / scale): {rows} (seed={seed})")
    assert_close(out[:n], ref[:n], torch.bfloat16, seed, scale=2.0)
