"""The MLA prologue kernel (kernels/mla_rope_write.py) against the torch path it replaces
(``MultiHeadLatentAttention._rope_norm_write_torch``'s ops: ``RMSNorm``, the pair or half
rotation, ``MLATorchBackend.write``): the rotated ``q_pe`` and the stored latent entries,
interleaved (DeepSeek-V2) and neox pairs, the tests' tiny dims and V2-Lite's, fp32 and
bf16 activations, a bf16 and an fp8 cache, padding slots (-1) and rows past
``num_actual_tokens`` left alone.

fp32 is exact but for the norm's statistics (summation order, rsqrt's last bits); bf16
within two ulps (the interpreter truncates fp32 -> bf16 casts); an fp8 entry within one
e4m3 step of the reference's."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE

from pagedllm.attention.kv_cache_dtype import quantize_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_torch import MLATorchBackend
from pagedllm.attention.rope import apply_rotary
from pagedllm.kernels.mla_rope_write import mla_rope_norm_write
from pagedllm.layers.mla import rotate_pairs
from pagedllm.layers.norm import RMSNorm

TINY = (3, 16, 32, 8)  # heads, Dn, L, R
V2_LITE = (16, 128, 512, 64)


def _meta(slots: torch.Tensor, n: int) -> AttentionMetadata:
    """Just what the write reads: ``slot_mapping`` and ``num_actual_tokens``."""
    meta = AttentionMetadata.__new__(AttentionMetadata)
    meta.slot_mapping, meta.num_actual_tokens = slots, n
    return meta


def _reference(q, ckv, norm, cos_sin, pos, interleaved, cache, slots, n, nope, k_scale):
    """The layer's torch prologue, step for step -> (rotated q_pe, cache)."""
    lat = ckv.shape[-1] - cos_sin.shape[-1]
    c_kv = norm(ckv[:, :lat].contiguous())
    k_pe = ckv[:, lat:].unsqueeze(1)
    cs = cos_sin.index_select(0, pos).to(q.dtype)
    cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
    x = torch.cat((q[..., nope:], k_pe), dim=1)
    pe = rotate_pairs(x, cos, sin) if interleaved else apply_rotary(x, cos, sin)
    MLATorchBackend.write(c_kv, pe[:, -1], cache, _meta(slots, n), k_scale)
    return pe[:, :-1], cache


@pytest.mark.parametrize("dims", [TINY, V2_LITE], ids=["tiny", "v2lite"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "neox"])
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn)], ids=["fp32", "bf16", "fp8cache"])
def test_equals_the_torch_prologue(dims, interleaved, dtype, cache_dtype) -> None:
    heads, nope, lat, rope = dims
    g = torch.Generator().manual_seed(7 + lat + rope + interleaved)
    t, nb, bs, max_pos = 7, 6, 4, 300
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(DEVICE)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(DEVICE)
    # q a view of a wider buffer (strided heads), ckv rows strided too.
    q = torch.randn(t, heads, nope + rope + 4, generator=g).to(DEVICE, dtype)[..., :nope + rope]
    ckv = torch.randn(t, lat + rope + 8, generator=g).to(DEVICE, dtype)[:, :lat + rope] * 3
    norm = RMSNorm(lat, 1e-6).to(DEVICE)
    norm.weight.data = (torch.rand(lat, generator=g) + 0.5).to(DEVICE, dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[2] = -1  # CUDA-graph padding
    slots = slots.to(DEVICE)
    n = t - 1  # the last row is past num_actual_tokens: not stored
    fill = torch.randn(1, nb, bs, 1, lat + rope, generator=g).to(DEVICE)
    fp8 = cache_dtype == torch.float8_e4m3fn
    before = quantize_kv(fill, 1.0) if fp8 else fill.to(cache_dtype)
    k_scale = 0.37 if fp8 else 1.0  # an fp8 entry is stored divided by it

    ref_q, ref_cache = _reference(q, ckv, norm, cos_sin, pos, interleaved, before.clone(),
                                  slots, n, nope, k_scale)
    cache = before.clone()
    got_q = mla_rope_norm_write(q, ckv, norm.weight, 1e-6, pos, cos_sin, cache, slots, n,
                                nope, interleaved=interleaved, k_scale=k_scale)

    assert got_q.shape == (t, heads, rope) and got_q.is_contiguous()
    # Two ulps of the inputs: ``x0 cos - x1 sin`` can cancel far below x0 and x1, so a
    # product's rounding is many ulps of a small result (and on a GPU the compiler fuses
    # it into an FMA, which rounds once where torch rounds twice: fp32 is not bit-exact).
    atol = 2 * torch.finfo(dtype).eps * q.abs().max().item()
    torch.testing.assert_close(got_q.float(), ref_q.float(), atol=atol, rtol=0)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[:n][slots[:n] >= 0].cpu()] = False
    flat, ref_flat, old = (c.view(nb * bs, -1).cpu() for c in (cache, ref_cache, before))
    if fp8:
        flat, ref_flat, old = (c.view(torch.uint8) for c in (flat, ref_flat, old))
    assert torch.equal(flat[untouched], old[untouched]), "padding / extra rows were written"
    written = ~untouched
    if fp8:
        a = flat[written].view(torch.float8_e4m3fn).float()
        b = ref_flat[written].view(torch.float8_e4m3fn).float()
        step = b.abs().clamp(min=2.0 ** -6) * 2.0 ** -3  # one e4m3 step at b's binade
        assert ((a - b).abs() <= step).all()
        assert (a == b).float().mean() > 0.99
    elif dtype == torch.float32:
        torch.testing.assert_close(flat[written], ref_flat[written], atol=1e-6, rtol=1e-6)
    else:
        a, b = flat[written].float(), ref_flat[written].float()
        # c_kv: two roundings (normalised, times the weight), each up to an ulp.
        torch.testing.assert_close(a[:, :lat], b[:, :lat], atol=1e-2, rtol=2.0 ** -6)
        atol = 2 * 2.0 ** -7 * ckv[:, lat:].abs().max().item()
        torch.testing.assert_close(a[:, lat:], b[:, lat:], atol=atol, rtol=0)


def test_refuses_bad_shapes() -> None:
    q = torch.zeros(2, 3, 24)
    ckv = torch.zeros(2, 40)
    cache = torch.zeros(1, 2, 4, 1, 40)
    cs = torch.zeros(10, 8)
    with pytest.raises(ValueError, match="mla_rope_norm_write"):
        mla_rope_norm_write(q, ckv, torch.ones(31), 1e-6, torch.zeros(2, dtype=torch.long),
                            cs, cache, torch.zeros(2, dtype=torch.long), 2, 16,
                            interleaved=True)
