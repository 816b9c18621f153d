"""The batch-1 QKV GEMV with rotary + KV-cache write in its epilogue
(``kernels/gemv_rope.py``) against the unfused path it replaces: ``gemv`` then
``rotary_and_write_kv``.  Both run the same per-row sums and roundings: under the
interpreter the rotated q and every cache element must be bit-identical.  On the GPU the
compiler may lay the two kernels' reductions out differently (fp32 sums in another
order), so there each value may differ by about one rounding of the activation dtype.
The caches start poisoned with NaN and are compared whole, so a write to a wrong slot,
head or column fails too."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU, fresh_seed

from pagedllm.kernels.gemv import gemv
from pagedllm.kernels.gemv_rope import gemv_qkv_rope, qkv_rope_supported
from pagedllm.kernels.lora import lora_shrink
from pagedllm.kernels.rotary import rotary_and_write_kv
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.worker.lora.layers import lora_ref

DTYPES = [torch.bfloat16] + ([torch.float16] if ON_GPU else [])


def _case(dtype: torch.dtype, head_dim: int, hq: int, hkv: int, k: int, bias: bool,
          slot: int, pos: int, seed: int, lora: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * head_dim
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    cs = rope.cos_sin_cache.to(DEVICE)
    positions = torch.tensor([pos], device=DEVICE)
    slots = torch.tensor([slot], dtype=torch.int64, device=DEVICE)
    block_size, num_blocks = 16, 4
    cache0 = torch.full((2, num_blocks, block_size, hkv, head_dim), float("nan"),
                        dtype=dtype, device=DEVICE)

    # A LoRA adapter (rank 4 on q, k and v; slot 1 of 2): its fp32 reference delta
    # joins the rounded projection, as LoRALinear.apply adds it; the kernel gets the
    # split-K shrink's partials and adds the expand in its epilogue.
    ref_cache = cache0.clone()
    qkv = gemv(x, w, b)
    epilogue = None
    if lora:
        sizes = (hq * head_dim, hkv * head_dim, hkv * head_dim)
        a = (torch.randn(2, 12, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
        bt = torch.zeros(2, 12, n)
        for i, off in enumerate((0, sizes[0], sizes[0] + sizes[1])):
            bt[:, 4 * i:4 * i + 4, off:off + sizes[i]] = torch.randn(2, 4, sizes[i],
                                                                     generator=gen)
        bt = bt.to(DEVICE, dtype)
        lslots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        delta = lora_ref(x.float(), lslots, a.float(), bt.float())
        qkv = (qkv.float() + delta).to(dtype)
        epilogue = lora_shrink(x, lslots, a, bt, (sizes[0], sizes[0] + sizes[1]))
    q_ref = qkv[:, :hq * head_dim].clone()
    rotary_and_write_kv(positions, q_ref, qkv[:, hq * head_dim:(hq + hkv) * head_dim],
                        qkv[:, (hq + hkv) * head_dim:], head_dim, cs, ref_cache, slots)

    got_cache = cache0.clone()
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    gemv_qkv_rope(x, w, b, positions, cs, got_cache, slots, num_heads=hq,
                  num_kv_heads=hkv, head_dim=head_dim, out=out, lora=epilogue)
    # Exact in the interpreter; on the GPU ~2 roundings of the dtype (module docstring).
    # (With a LoRA delta the reference rounds its add in torch, which rounds to nearest;
    # the interpreter's casts truncate: one ulp apart.)  An ulp is one of the *inputs*
    # to the rotation: q1·cos − q2·sin can cancel to a value far smaller than q1 and q2,
    # so the absolute tolerance is two ulps of the largest pre-rotation value.
    eps = torch.finfo(dtype).eps
    tol = {"rtol": 0, "atol": 0} if not ON_GPU and not lora else \
        {"rtol": 2 * eps, "atol": 2 * eps * max(1.0, float(qkv.float().abs().max()))}
    torch.testing.assert_close(out[:, :hq * head_dim], q_ref, **tol,
                               msg=lambda m: f"rotated q differs (seed={seed}): {m}")
    torch.testing.assert_close(got_cache, ref_cache, equal_nan=True, **tol,
                               msg=lambda m: f"KV cache differs (seed={seed}): {m}")
    if slot >= 0:  # the written slot really holds numbers (the reference wrote there)
        blk, off = divmod(slot, block_size)
        assert not got_cache[:, blk, off].isnan().any(), f"slot not written (seed={seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 4, 2), (128, 2, 1), (32, 3, 3)])
def test_matches_gemv_then_rotary_write(dtype: torch.dtype, head_dim: int, hq: int,
                                        hkv: int) -> None:
    seed = fresh_seed()
    _case(dtype, head_dim, hq, hkv, k=96, bias=False, slot=21, pos=37, seed=seed)
    _case(dtype, head_dim, hq, hkv, k=256, bias=True, slot=5, pos=3, seed=seed + 1)


def test_padding_slot_writes_nothing() -> None:
    """Slot -1 (a CUDA-graph padding row): q is still produced, the cache untouched."""
    _case(torch.bfloat16, 64, 2, 1, k=64, bias=False, slot=-1, pos=9, seed=fresh_seed())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_delta_joins_before_rotation(dtype: torch.dtype) -> None:
    """A LoRA adapter's delta (split-K shrink, expand in the epilogue) is added before
    q/k are rotated and k/v cached; fp16 models take the same path."""
    _case(dtype, 64, 2, 1, k=64, bias=True, slot=3, pos=11, seed=fresh_seed(), lora=True)


def test_supported_shapes_and_errors() -> None:
    assert qkv_rope_supported(128, 128) and qkv_rope_supported(64, 64)
    assert not qkv_rope_supported(128, 64)  # partial rotary stays unfused
    assert not qkv_rope_supported(12, 12)
    cache = torch.zeros(2, 1, 16, 1, 64, device=DEVICE, dtype=torch.bfloat16)
    cs = torch.zeros(8, 64, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    w = torch.zeros(4 * 64, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv_qkv_rope(torch.zeros(2, 32, device=DEVICE, dtype=torch.bfloat16), w, None,
                      one, cs, cache, one, num_heads=2, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="expected"):
        gemv_qkv_rope(torch.zeros(1, 32, device=DEVICE, dtype=torch.bfloat16), w, None,
                      one, cs, cache, one, num_heads=1, num_kv_heads=1, head_dim=64)
