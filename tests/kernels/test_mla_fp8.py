"""An fp8 (e4m3) MLA latent cache (``kv_cache_dtype="fp8"``): the decode kernel
(``kernels/mla_decode.py``) against its torch oracle reading the same fp8 entries, the
backend's write and every read path (``attention/mla_torch.py``), and what the fp8 cache
costs in accuracy against a full-precision one.

Accuracy, stated.  An entry is stored as ``e4m3(x / k_scale)``: in e4m3's normal range
(``|x / k_scale| >= 2^-6``) the relative error of one element is at most ``2^-4`` (3
mantissa bits, round to nearest); below it the absolute error is at most ``2^-10 *
k_scale`` (half the subnormal spacing); ``|x / k_scale| > 448`` saturates.  An output
is a convex combination of latents, so its error is measured against the latents'
magnitude: over N(0, 1) latents and queries at these shapes (scores of unit spread) the
fp8 cache's outputs differ from the fp32 cache's by at most 0.024 (decode) and 0.026
(3- and 2-token verify) x max |latent| over 20 seeds (0.10 absolute, max |latent| ~ 4.5);
the test asserts 0.04.  Against its oracle over the same fp8 entries the kernel agrees to
fp32 rounding (bf16 queries: to bf16 output rounding).  Interpreted shapes stay tiny
(L = 64, R = 16)."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, assert_close

from pagedllm.attention.kv_cache_dtype import FP8_KV_DTYPE, quantize_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_torch import MLADims, MLATorchBackend
from pagedllm.kernels.mla_decode import MlaLaunch, mla_decode, mla_decode_ref, plan_mla_decode

LAT, ROPE = 64, 16
# Output error of the fp8 cache against the fp32 cache, relative to max |latent|.
FP8_OUTPUT_TOL = 0.04


def _batch(q_lens: list[int], seq_lens: list[int], heads: int, seed: int,
           block_size: int = 16, k_scale: float = 1.0, outliers: bool = False):
    """Queries (fp32) and a full-precision latent cache (values ~ N(0, 1); with
    ``outliers`` two elements of each block's first slot x 40, which saturate at small
    scales), blocks scattered over a shuffled pool with junk ids past each table's last
    block; and the same cache as fp8 (``quantize_kv``)."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 3
    cache = torch.randn(1, num_blocks, block_size, 1, LAT + ROPE, generator=g)
    if outliers:
        cache[0, :, 0, 0, :2] *= 40.0
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(per_req) + 2), generator=g)
    used = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = perm[used:used + n]
        used += n
    t = sum(q_lens)
    q_lat = torch.randn(t, heads, LAT, generator=g)
    q_pe = torch.randn(t, heads, ROPE, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    i32 = {"device": DEVICE, "dtype": torch.int32}
    return (q_lat.to(DEVICE), q_pe.to(DEVICE), cache.to(DEVICE),
            quantize_kv(cache, k_scale).to(DEVICE), tables.to(**i32),
            torch.tensor(seq_lens).to(**i32), qsl.to(**i32))


def _ref(q_lat, q_pe, cache, tables, seqs, qsl, scale, k_scale=1.0) -> torch.Tensor:
    return mla_decode_ref(q_lat.cpu().float(), q_pe.cpu().float(), cache.cpu(),
                          tables.cpu(), seqs.cpu(), qsl.cpu(), scale, k_scale=k_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale", [1.0, 0.03])
@pytest.mark.parametrize("launch", [
    MlaLaunch(block_h=16, block_q=1, block_n=32, num_splits=1),
    MlaLaunch(block_h=16, block_q=1, block_n=16, num_splits=3),
], ids=["tiles-straddle-blocks", "split3"])
def test_decode_equals_the_fp8_reference(dtype: torch.dtype, k_scale: float,
                                         launch: MlaLaunch) -> None:
    """Ragged tables over 8-slot blocks: contexts of 1, 13, 40 and 33 positions (partial
    last blocks), 32-position tiles spanning four blocks, or uneven splits with empty
    ones.  Outliers up to ~100: at ``k_scale`` 0.03 they saturate (|x| / 0.03 > 448)."""
    q_lat, q_pe, _, fp8, tables, seqs, qsl = _batch([1, 1, 1, 1], [1, 13, 40, 33], 4,
                                                    seed=11, block_size=8, k_scale=k_scale,
                                                    outliers=True)
    if k_scale != 1.0:
        assert fp8.float().abs().max() == 448.0  # saturated, not inf / NaN
    scale = (LAT + ROPE) ** -0.5
    got = mla_decode(q_lat.to(dtype), q_pe.to(dtype), fp8, tables, seqs, qsl, scale, 1,
                     launch=launch, k_scale=k_scale)
    ref = _ref(q_lat.to(dtype), q_pe.to(dtype), fp8, tables, seqs, qsl, scale, k_scale)
    assert got.dtype == dtype
    assert_close(got, ref, dtype, 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_queries_and_the_default_plan(dtype: torch.dtype) -> None:
    """Speculative-verify shapes (3, 1, 4 and 2 new tokens; the causal mask inside the
    query block) through the default fp8 plan."""
    q_lat, q_pe, _, fp8, tables, seqs, qsl = _batch([3, 1, 4, 2], [21, 9, 4, 70], 4,
                                                    seed=12, k_scale=0.5)
    got = mla_decode(q_lat.to(dtype), q_pe.to(dtype), fp8, tables, seqs, qsl, 0.1, 4,
                     k_scale=0.5)
    assert_close(got, _ref(q_lat.to(dtype), q_pe.to(dtype), fp8, tables, seqs, qsl, 0.1,
                           0.5), dtype, 12)


@pytest.mark.parametrize("case", ["decode", "verify"])
def test_fp8_cache_against_full_precision(case: str) -> None:
    """The cost of the fp8 cache: per element within e4m3's bound, and the kernel's
    output over it within ``FP8_OUTPUT_TOL`` x max |latent| of the fp32 cache's."""
    q_lens, seq_lens = ([1, 1, 1], [64, 7, 41]) if case == "decode" else ([3, 2], [30, 50])
    q_lat, q_pe, full, fp8, tables, seqs, qsl = _batch(q_lens, seq_lens, 4, seed=13)
    deq = fp8.float()
    normal = full.abs() >= 2 ** -6
    assert bool(((deq - full).abs() <= 2 ** -4 * full.abs())[normal].all())
    assert bool(((deq - full).abs() <= 2 ** -10)[~normal].all())
    scale = (LAT + ROPE) ** -0.5
    got = mla_decode(q_lat, q_pe, fp8, tables, seqs, qsl, scale, max(q_lens))
    exact = mla_decode(q_lat, q_pe, full, tables, seqs, qsl, scale, max(q_lens))
    err = float((got - exact).abs().max() / full.abs().max())
    print(f"fp8 vs fp32 cache ({case}): max |err| / max |latent| = {err:.4f}")
    assert 0.0 < err <= FP8_OUTPUT_TOL


def _meta(seq_lens: list[int], q_lens: list[int], tables: torch.Tensor,
          block_size: int, pad: int = 0) -> AttentionMetadata:
    """Metadata whose new tokens sit at the end of each request's context; ``pad``
    padding rows of slot -1."""
    slots = []
    for r, (s, q) in enumerate(zip(seq_lens, q_lens)):
        for p in range(s - q, s):
            slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
    slots += [-1] * pad
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(q_lens) + pad, num_reqs=len(q_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(DEVICE), seq_lens=seq.to(DEVICE),
        block_tables=tables.to(DEVICE), slot_mapping=torch.tensor(slots).to(DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, block_size=block_size)


def test_backend_write_and_reads() -> None:
    """``MLATorchBackend.write`` stores ``quantize_kv([c_kv | k_pe], k_scale)`` (slot -1
    rows skipped), and the backend's reads over it -- the kernel (interpreted), the torch
    absorbed path and the expanded form -- equal attention over the dequantised entries:
    absorbed forms to fp32 rounding against the oracle, the expanded form (a different
    factorisation through ``kv_b_proj``) to the absorbed one."""
    block_size, k_scale = 8, 0.25
    seq_lens, q_lens = [13, 21, 6], [1, 1, 1]
    _, _, _, fp8, tables, seqs, qsl = _batch(q_lens, seq_lens, 4, seed=14,
                                             block_size=block_size, k_scale=k_scale)
    g = torch.Generator().manual_seed(15)
    c_kv, k_pe = torch.randn(5, LAT, generator=g), torch.randn(5, ROPE, generator=g)
    c_kv[0, :3] = 1e3  # saturates: 1e3 / 0.25 > 448
    meta = _meta(seq_lens, q_lens, tables.cpu(), block_size, pad=2)
    before = fp8.view(torch.uint8).view(-1, LAT + ROPE).clone()
    MLATorchBackend.write(c_kv.to(DEVICE), k_pe.to(DEVICE), fp8, meta, k_scale)
    meta = _meta(seq_lens, q_lens, tables.cpu(), block_size)
    flat = fp8.view(torch.uint8).view(-1, LAT + ROPE)
    written = flat[meta.slot_mapping[:3]].view(FP8_KV_DTYPE).float()
    want = quantize_kv(torch.cat((c_kv, k_pe), -1)[:3], k_scale).float()
    assert torch.equal(written.cpu(), want)
    assert float(written.abs().max()) == 448.0
    changed = (flat != before).any(-1).nonzero().flatten().tolist()
    want_slots = sorted(meta.slot_mapping[:3].tolist())
    if fp8.device.type != "cpu":
        # Off the CPU the pads write the null block 0 (no boolean indexing: CUDA graphs
        # capture the write), which the block pool never hands to a request.
        assert min(want_slots) >= block_size
        changed = [c for c in changed if c >= block_size]
    assert changed == want_slots  # pads skipped

    heads, dn, dv = 4, 8, 12
    dims = MLADims(heads, LAT, dn, ROPE, dv)
    q_nope = torch.randn(3, heads, dn, generator=g).to(DEVICE)
    q_pe = torch.randn(3, heads, ROPE, generator=g).to(DEVICE)
    w = (torch.randn(heads * (dn + dv), LAT, generator=g) * 0.1).to(DEVICE)
    w3 = w.view(heads, dn + dv, LAT)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w3[:, :dn]).transpose(0, 1)
    o_lat = _ref(q_lat, q_pe, fp8, tables, seqs, qsl, 0.2, k_scale).to(DEVICE)
    ref = torch.bmm(o_lat.transpose(0, 1), w3[:, dn:].transpose(1, 2)).transpose(0, 1)
    outs = {}
    for name, mode, kernel in [("kernel", "auto", True), ("torch", "auto", False),
                               ("absorbed", "absorbed", False),
                               ("expanded", "expanded", False)]:
        backend = MLATorchBackend()
        backend.kernel_on_cpu = kernel
        outs[name] = backend.forward(q_nope, q_pe, fp8, meta, 0.2, w, dims, mode, k_scale)
    for name in ("kernel", "torch", "absorbed"):
        assert_close(outs[name], ref, torch.float32, 14)
    assert_close(outs["expanded"], outs["absorbed"], torch.float32, 14)


def test_fp8_plan() -> None:
    """The fp8 plan's rows and warps (what compiled without spills for sm_90:
    ``test_deepseek_kernels_sm90.py``): V3's 128 heads in 32-head blocks, V2-Lite's 16
    heads at 8 warps; a bf16 cache keeps 64-head blocks."""
    p = plan_mla_decode(num_reqs=256, max_query_len=1, num_heads=128, kv_lora_rank=512,
                        kv_fp8=True)
    assert (p.block_h, p.num_warps) == (32, 8)
    p = plan_mla_decode(num_reqs=64, max_query_len=1, num_heads=16, kv_lora_rank=512,
                        kv_fp8=True)
    assert (p.block_h, p.block_q, p.num_warps) == (16, 1, 8)
    p = plan_mla_decode(num_reqs=64, max_query_len=4, num_heads=16, kv_lora_rank=512,
                        kv_fp8=True)
    assert p.block_h * p.block_q == 32
    assert plan_mla_decode(num_reqs=256, max_query_len=1, num_heads=128,
                           kv_lora_rank=512).block_h == 64


def test_fp8_cache_checks_query_dtypes() -> None:
    q_lat, q_pe, _, fp8, tables, seqs, qsl = _batch([1], [5], 4, seed=16)
    with pytest.raises(ValueError, match="fp8"):
        mla_decode(q_lat, q_pe.to(torch.bfloat16), fp8, tables, seqs, qsl, 0.1, 1)
    assert fp8.dtype == FP8_KV_DTYPE
