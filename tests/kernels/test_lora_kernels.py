"""The Triton LoRA kernels (``kernels/lora.py``: the one-launch fused form;
``kernels/lora_masked.py``: the masked split-K form) against the torch reference
(``worker/lora/layers.lora_ref``), rows mixing slots and -1, unsorted."""

from __future__ import annotations

import textwrap

import pytest
import torch

from pagedllm.worker.lora.layers import lora_ref
from tests.kernels.sm90_compile import run_script


def _case(t: int, k: int, n: int, slots: int, r: int, dtype: torch.dtype, device: str,
          sizes: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """Rows ``x [t, k]``, ``a [slots, r, k]``, ``bt [slots, r, n]``, slots ``idx`` and a
    base output ``y``.  With ``sizes`` (output shards summing to ``n``), ``r`` is ``S *
    rank`` and ``bt`` is block-diagonal over the shards: ``LoRALinear``'s stacked layout,
    the one ``lora_fused`` is specified for (it reads only shard i's rank rows for shard
    i's outputs); without, ``bt`` is dense."""
    g = torch.Generator().manual_seed(t * 7 + k + n)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    a = torch.randn(slots, r, k, generator=g).to(device, dtype) / k ** 0.5
    bt = torch.randn(slots, r, n, generator=g)
    if sizes is not None:
        rank, off = r // len(sizes), 0
        mask = torch.zeros(r, n, dtype=torch.bool)
        for i, size in enumerate(sizes):
            mask[i * rank:(i + 1) * rank, off:off + size] = True
            off += size
        bt = bt * mask
    bt = bt.to(device, dtype)
    # Every slot, and rows without an adapter (-1), interleaved (unsorted).
    idx = torch.randint(-1, slots, (t,), generator=g).to(device, torch.int32)
    y = torch.randn(t, n, generator=g).to(device, dtype)
    return x, a, bt, idx, y


# Unit of the last place at 1 (the interpreter truncates bf16 conversions, so a whole
# ulp, not the half of round-to-nearest).
_EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


def _rounding_bound(x: torch.Tensor, idx: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                    want: torch.Tensor, shrink_rounded: bool) -> torch.Tensor:
    """Per-element bound on ``|got - want|`` for ``got = round(y + delta)`` computed as
    the kernels do, ``want`` the fp32 reference (inputs exact in fp32).  The terms:

    * the one rounding of the output to its dtype: ``eps * |want|``;
    * the masked form (``shrink_rounded``) rounds each shrink value ``s_r`` to the
      weights' dtype before the expand (as vLLM's punica does):
      ``eps * sum_r |s_r| |Bt[r, n]|``.  With cancellation (``y + delta ~ 0``) this
      term, not ``|want|``, dominates: a fixed rtol/atol fails there although the kernel
      is right;
    * fp32 sums over K and the rank (worst case ``(K + SR) * 2^-24`` of the sums of
      absolute terms, propagated through the expand).

    A wrong shard, slot or row is off by O(``sum_r |s_r| |Bt|``), far outside it."""
    eps = _EPS[x.dtype]
    n_slots, sr, k = a.shape
    owner = torch.arange(n_slots, device=x.device).repeat_interleave(sr)
    mask = idx.long().unsqueeze(1) == owner.unsqueeze(0)
    shrunk = x.float() @ a.float().reshape(n_slots * sr, k).t()
    absx = x.float().abs() @ a.float().abs().reshape(n_slots * sr, k).t()
    absb = bt.float().abs().reshape(n_slots * sr, -1)
    mag = torch.where(mask, shrunk.abs(), 0) @ absb
    mag_x = torch.where(mask, absx, 0) @ absb
    gamma = (k + sr) * 2.0 ** -24
    return eps * want.abs() + (eps if shrink_rounded else 0.0) * mag + gamma * (mag + mag_x)


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor,
                   what: str) -> None:
    err = (got.float() - want).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} / {err.numel()} elements outside the rounding bound; "
        f"worst err/bound {(err / bound.clamp_min(1e-30)).max().item():.3g}")


def _check_sharded_case(t: int, k: int, sizes: tuple[int, ...], rank: int, n_slots: int,
                        dtype: torch.dtype, device: str) -> None:
    """``lora_fused`` over the first 4 rows (the fused path's row count) and the masked
    form over all ``t`` on a q/k/v-like layer with block-diagonal ``Bt``, against the fp32
    reference within :func:`_rounding_bound`; rows without an adapter bit-for-bit."""
    from pagedllm.kernels.lora import lora_fused

    n = sum(sizes)
    x, a, bt, idx, y = _case(t, k, n, n_slots, len(sizes) * rank, dtype, device, sizes)
    assert (idx[:4] >= 0).any() and (idx < 0).any()
    want = y.float() + lora_ref(x.float(), idx, a.float(), bt.float())
    bounds = tuple(int(b) for b in torch.tensor(sizes).cumsum(0)[:-1])
    got = lora_fused(x[:4], idx[:4], a, bt, bounds, y=y[:4].clone())
    _assert_within(got, want[:4], _rounding_bound(x[:4], idx[:4], a, bt, want[:4], False),
                   "fused")
    assert torch.equal(got[idx[:4] < 0], y[:4][idx[:4] < 0])
    # The masked split-K shrink + one addmm (kernels/lora_masked.py), default config:
    # its shrink is rounded to the weights' dtype before the expand.
    from pagedllm.kernels.lora_masked import lora_masked_, new_counters

    counters = new_counters(torch.device(device))
    got = lora_masked_(x, idx, a, bt, counters, y.clone())
    _assert_within(got, want, _rounding_bound(x, idx, a, bt, want, True), "masked")
    assert torch.equal(got[idx < 0], y[idx < 0])
    assert not counters.any()


@pytest.mark.parametrize("t,k,slots,r,config", [
    (37, 600, 3, 6, (16, 16, 64, 10)),   # K split in 10: the last program sums in order
    (37, 600, 3, 6, (64, 32, 1024, 1)),  # one split: stored directly
    (70, 130, 4, 12, None),              # the default config (16 splits of 256 -> 1)
    (40, 200, 8, 16, (16, 16, 64, 4)),   # one slot per column block: idle tiles skip
])
def test_masked_shrink_matches_reference(t: int, k: int, slots: int, r: int,
                                         config: tuple[int, int, int, int] | None,
                                         device: str) -> None:
    """``lora_masked_shrink``: each row's own slot's columns hold ``x A^T``, every
    other column exact zeros (also for rows without an adapter), whatever the split;
    the counters are left zero for the next launch (graph replays)."""
    from pagedllm.kernels.lora_masked import lora_masked_shrink, new_counters

    x, a, _, idx, _ = _case(t, k, 8, slots, r, torch.float32, device)
    if slots == 8:  # rows of slots 0 and 5 only: most column blocks have no row
        idx = torch.where(idx % 2 == 0, 0, 5).to(idx.dtype)
    counters = new_counters(torch.device(device))
    for _ in range(2):  # a second launch finds the counters reset
        got = lora_masked_shrink(x, idx, a, counters, config=config)
        owner = torch.arange(slots, device=device).repeat_interleave(r)
        mask = idx.long().unsqueeze(1) == owner.unsqueeze(0)
        full = x @ a.reshape(slots * r, k).t()
        torch.testing.assert_close(got[mask], full[mask], rtol=1e-5, atol=1e-5)
        assert not got[~mask].any()
        assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_half_precision_matches_reference(dtype: torch.dtype, device: str) -> None:
    """The GPU-size test below at interpreter sizes: half precision, 4 fused rows,
    3 shards (q/k/v) whose bounds halve the fused kernel's blocks, 37 masked rows."""
    _check_sharded_case(37, 96, (64, 32, 32), 4, 3, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_kernels_gpu_sizes(dtype: torch.dtype, device: str) -> None:
    """An 8B layer's shape (qkv: 4096 -> 4096 + 1024 + 1024, 3 shards of rank 16,
    8 slots), 300 rows."""
    _check_sharded_case(300, 4096, (4096, 1024, 1024), 16, 8, dtype, device)


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` rounded as ``kernels/activation.py`` rounds it."""
    g, u = gu.chunk(2, dim=-1)
    act = (g.float() / (1 + torch.exp(-g.float()))).to(gu.dtype)
    return (act.float() * u.float()).to(gu.dtype)


@pytest.mark.parametrize("t,k,sizes,r,silu", [
    (1, 40, (24,), 6, False),          # one shard, decode row
    (5, 72, (20, 8, 8), 5, False),     # q/k/v shards, a block straddling shard bounds
    (4, 33, (40, 40), 4, True),        # gate/up shards; down's silu(gate)*up input
])
def test_fused_matches_reference(t: int, k: int, sizes: tuple[int, ...], r: int,
                                 silu: bool, device: str) -> None:
    """One launch (shrink + expand), mixed slots incl. -1, block-diagonal shards."""
    from pagedllm.kernels.lora import lora_fused

    g = torch.Generator().manual_seed(t + k)
    n_slots, n, s = 3, sum(sizes), len(sizes)
    x = torch.randn(t, 2 * k if silu else k, generator=g)
    a = torch.randn(n_slots, s * r, k, generator=g) / k ** 0.5
    bt = torch.zeros(n_slots, s * r, n)
    off = 0
    for i, size in enumerate(sizes):  # B block-diagonal over the shards
        bt[:, i * r:(i + 1) * r, off:off + size] = torch.randn(n_slots, r, size, generator=g)
        off += size
    slots = torch.tensor([-1, 2, 0, 1, 2][:t] if t > 1 else [1], dtype=torch.int32)
    y = torch.randn(t, n, generator=g)
    xin = _silu_mul(x) if silu else x
    want = lora_ref(xin, slots, a, bt)
    bounds = tuple(int(b) for b in torch.tensor(sizes).cumsum(0)[:-1])
    dev = [z.to(device) for z in (x, slots, a, bt, y)]
    # Small blocks so that programs cross shard bounds and K takes several steps.
    got = lora_fused(dev[0], dev[1], dev[2], dev[3], bounds, silu_mul=silu,
                     config=(16, 16, 1))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    added = lora_fused(dev[0], dev[1], dev[2], dev[3], bounds, y=dev[4].clone(),
                       silu_mul=silu, config=(16, 16, 1)).cpu()
    torch.testing.assert_close(added, y + want, rtol=1e-4, atol=1e-4)
    assert torch.equal(added[slots < 0], y[slots < 0])


_COMPILE = textwrap.dedent(r"""
    import json
    import triton
    from tests.kernels.sm90_compile import compile_sm90
    from pagedllm.kernels import lora as L

    def build(kernel, sig, consts, warps):
        div = [i for i, n in enumerate(sig) if n not in ("B1", "B2", "eps", "SPLIT")]
        return compile_sm90(kernel, sig, consts, {"num_warps": warps},
                            div)[1]["spill_stores"]

    i32, out = "i32", {}
    # The fused kernel at the decode shapes it serves: qkv (fp32 delta for the RoPE
    # GEMV), gate_up (2 shards), down (reading silu(gate)*up).
    for name, n, k, s, silu, store in [("qkv", 6144, 4096, 3, False, True),
                                       ("gate_up", 28672, 4096, 2, False, False),
                                       ("down", 4096, 14336, 1, True, False)]:
        bn, bk, warps = L.fused_config(n, k)
        sig = {"x_ptr": "*bf16", "slots_ptr": "*i32", "a_ptr": "*bf16", "bt_ptr": "*bf16",
               "y_ptr": "*fp32" if store else "*bf16", "N": i32, "B1": i32, "B2": i32,
               "stride_x": i32, "stride_y": i32, "stride_as": i32, "stride_bs": i32}
        out["fused " + name] = build(L._fused_kernel, sig, dict(
            K=k, R=16, SILU_MUL=silu, STORE=store, BLOCK_N=bn, BLOCK_K=bk,
            BLOCK_R=16, USE_PDL=True), warps)
    # Batch 1: the split-K shrink and the GEMVs with the expand in their epilogue.
    from pagedllm.kernels import gemv as G, gemv_rope as GR
    for name, n, k, s, silu in [("qkv", 6144, 4096, 3, False),
                                ("gate_up", 28672, 4096, 2, False),
                                ("o", 4096, 4096, 1, False),
                                ("down", 4096, 14336, 1, True)]:
        chunk, warps = L.shrink_config(k)
        split = triton.next_power_of_2(triton.cdiv(k, chunk))
        sig = {"x_ptr": "*bf16", "slots_ptr": "*i32", "a_ptr": "*bf16", "t_ptr": "*fp32",
               "stride_as": i32}
        out["shrink " + name] = build(L._shrink_kernel, sig, dict(
            K=k, R=16, SR=16 * s, SILU_MUL=silu, CHUNK=chunk, BLOCK_R=16,
            USE_PDL=True), warps)
        lora = dict(HAS_LORA=True, LORA_R=16, LORA_SR=16 * s, LORA_SPLIT=split,
                    LORA_BLOCK_R=16)
        bn, bk, warps = G.gemv_config(n, k)
        sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
        sig.update({"xs_ptr": "*fp32", "ws_ptr": "*fp32", "ls_ptr": "*i32",
                    "lt_ptr": "*fp32", "lb_ptr": "*bf16", "N": i32, "stride_wn": i32,
                    "stride_lb": i32, "B1": i32, "B2": i32})
        out["gemv+lora " + name] = build(G._gemv_kernel, sig, dict(
            K=k, HAS_BIAS=False, SILU_MUL=silu, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=True,
            SCALED=False, **lora), warps)
        if name == "qkv":
            sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}
            sig.update({"pos_ptr": "*i64", "cs_ptr": "*fp32", "k_cache_ptr": "*bf16",
                        "v_cache_ptr": "*bf16", "slot_ptr": "*i64", "ls_ptr": "*i32",
                        "lt_ptr": "*fp32", "lb_ptr": "*bf16"})
            sig.update({p: i32 for p in ("stride_wn", "stride_c", "stride_cb",
                                         "stride_cs", "stride_ch", "stride_lb", "B1",
                                         "B2")})
            out["gemv_qkv_rope+lora"] = build(GR._gemv_qkv_rope_kernel, sig, dict(
                K=k, NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
                HAS_BIAS=False, PAIRS=GR.PAIRS, BLOCK_K=512, USE_PDL=True, **lora), 4)
        if name in ("qkv", "gate_up"):  # their shrink in the norm's launch
            from pagedllm.kernels import lora_norm as LN
            sig = {p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr",
                                        "res_out_ptr")}
            sig.update({"slots_ptr": "*i32", "a_ptr": "*bf16", "t_ptr": "*fp32",
                        "stride_as": i32, "n_cols": i32, "eps": "fp32"})
            out["rms_norm_shrink " + name] = build(LN._rms_norm_shrink_kernel, sig, dict(
                HAS_RESIDUAL=True, BLOCK=k, K=k, R=16, SR=16 * s, CHUNK=chunk,
                BLOCK_R=16, USE_PDL=True), 16)
    # Many rows: the masked split-K shrink (kernels/lora_masked.py) at M = 16, 256
    # (split K, the in-kernel fixup) and 2048 (one split), 8 slots of rank 16.
    from pagedllm.kernels import lora_masked as LM
    for name, k, s in [("qkv", 4096, 3), ("gate_up", 4096, 2), ("o", 4096, 1),
                       ("down", 14336, 1)]:
        for m in (16, 256, 2048):
            bm, bn, chunk, split = LM.masked_config(m, 8 * 16 * s, k)
            sig = {"x_ptr": "*bf16", "slots_ptr": "*i32", "a_ptr": "*bf16",
                   "t_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": i32,
                   "LSR": i32, "stride_x": i32, "stride_t": i32, "stride_ws": i32,
                   "SPLIT": i32}
            out[f"masked {name} M={m} split={split}"] = build(
                LM._masked_shrink_kernel, sig, dict(
                    K=k, CHUNK=chunk, MAX_SPLIT=LM.MAX_SPLIT, SR=16 * s,
                    SR_P2=triton.next_power_of_2(16 * s), BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_K=LM.BLOCK_K, IEEE=False), 8)
    print(json.dumps(out))
""")


def test_lora_kernels_compile_for_sm90_without_spills(tmp_path) -> None:
    """The interpreter runs what the GPU compiler may reject (dynamic branches around
    loops and dots, constexpr ternaries): compile each for sm_90 at the Llama-3-8B
    shapes, no GPU needed (the pattern of ``test_quant_gemm_sm90.py``)."""
    spills = run_script(_COMPILE, tmp_path)
    assert len(spills) == 26 and not any(spills.values()), spills


def _stacked(g: torch.Generator, n_slots: int, k: int, sizes: tuple[int, ...], r: int,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [L, S*R, K] and Bt [L, S*R, N], block-diagonal over the shards (LoRALinear)."""
    n, s = sum(sizes), len(sizes)
    a = torch.randn(n_slots, s * r, k, generator=g) / k ** 0.5
    bt = torch.zeros(n_slots, s * r, n)
    off = 0
    for i, size in enumerate(sizes):
        bt[:, i * r:(i + 1) * r, off:off + size] = torch.randn(n_slots, r, size, generator=g)
        off += size
    return a, bt


@pytest.mark.parametrize("k,sizes,r,silu,slot", [
    (300, (24,), 6, False, 1),       # one shard; 5 K chunks of 64 padded to 8 partials
    (72, (16, 8, 8), 5, False, 2),   # q/k/v shards (GEMV blocks of 8 rows in one shard)
    (130, (40,), 4, True, 0),        # down: the shrink reads silu(gate) * up
    (64, (24, 24), 3, False, -1),    # gate/up, a row without an adapter
])
def test_gemv_lora_epilogue_matches_reference(k: int, sizes: tuple[int, ...], r: int,
                                              silu: bool, slot: int, device: str) -> None:
    """Batch 1: the split-K shrink (``lora_shrink``) then the base GEMV adding the expand
    in its epilogue, against the plain GEMV plus the fp32 reference delta; without an
    adapter, bit-for-bit the plain GEMV."""
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.lora import lora_shrink

    g = torch.Generator().manual_seed(k + r)
    n = sum(sizes)
    a, bt = _stacked(g, 3, k, sizes, r)
    x = torch.randn(1, 2 * k if silu else k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    slots = torch.tensor([slot], dtype=torch.int32)
    want = (x @ w.T if not silu else _silu_mul(x) @ w.T) + b
    want = want + lora_ref(_silu_mul(x) if silu else x, slots, a, bt)
    bounds = tuple(int(v) for v in torch.tensor(sizes).cumsum(0)[:-1])
    x, w, b, slots, a, bt = (z.to(device) for z in (x, w, b, slots, a, bt))
    lora = lora_shrink(x, slots, a, bt, bounds, silu_mul=silu)
    if k == 300:
        assert lora.split == 8  # 5 chunks and 3 zero ones
    got = gemv(x, w, b, silu_mul=silu, lora=lora)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    plain = gemv(x, w, b, silu_mul=silu)
    if slot < 0:
        assert torch.equal(got, plain)
    else:  # the adapter really moved the output
        assert (got - plain).abs().max().item() > 1e-2


@pytest.mark.parametrize("k,sizes,r,silu,slot", [
    (72, (16, 8, 8), 5, False, 2),   # q/k/v shards
    (130, (40,), 4, True, 0),        # down: silu(gate) * up rounded to fp16 first
    (64, (24, 24), 3, False, -1),    # gate/up, no adapter: the plain GEMV bit for bit
])
def test_gemv_lora_epilogue_fp16(k: int, sizes: tuple[int, ...], r: int, silu: bool,
                                 slot: int, device: str) -> None:
    """The batch-1 path of an fp16 model: ``lora_shrink`` + the GEMV's epilogue adds the
    fp32 delta to the fp16-rounded output and rounds once more, so it is the plain GEMV
    plus the fp32 reference delta within :func:`_rounding_bound`."""
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.lora import lora_shrink

    g = torch.Generator().manual_seed(k + r + 16)
    a, bt = (z.to(device, torch.float16) for z in _stacked(g, 3, k, sizes, r))
    x = torch.randn(1, 2 * k if silu else k, generator=g).to(device, torch.float16)
    w = (torch.randn(sum(sizes), k, generator=g) / k ** 0.5).to(device, torch.float16)
    slots = torch.tensor([slot], dtype=torch.int32, device=device)
    bounds = tuple(int(v) for v in torch.tensor(sizes).cumsum(0)[:-1])
    lora = lora_shrink(x, slots, a, bt, bounds, silu_mul=silu)
    got = gemv(x, w, silu_mul=silu, lora=lora)
    plain = gemv(x, w, silu_mul=silu)
    assert got.dtype == torch.float16
    if slot < 0:
        assert torch.equal(got, plain)
        return
    xin = _silu_mul(x) if silu else x
    want = plain.float() + lora_ref(xin.float(), slots, a.float(), bt.float())
    _assert_within(got, want, _rounding_bound(xin, slots, a, bt, want, False), "epilogue")
    assert (got.float() - plain.float()).abs().max().item() > 1e-2


@pytest.mark.parametrize("k,sizes,r,residual,slot,dtype", [
    (300, (24,), 6, True, 1, torch.float32),        # ragged K, padded partials
    (256, (16, 8, 8), 5, False, 2, torch.bfloat16),  # q/k/v shards, no residual
    (64, (24, 24), 3, True, -1, torch.bfloat16),     # gate/up, no adapter
    (128, (64, 32, 32), 4, True, 1, torch.float16),  # an fp16 model's q/k/v
])
def test_rms_norm_shrink_matches_norm_and_reference(
        k: int, sizes: tuple[int, ...], r: int, residual: bool, slot: int,
        dtype: torch.dtype, device: str) -> None:
    """The norm + shrink launch (``kernels/lora_norm.py``): its norm outputs bit-equal
    to ``kernels/norm.py``'s; the GEMV adding the expand from its partials against the
    fp32 reference delta of the stored normalised row."""
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.lora_norm import rms_norm_shrink
    from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(k + r)
    n = sum(sizes)
    a, bt = _stacked(g, 3, k, sizes, r)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    res = torch.randn(1, k, generator=g).to(device, dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    slots = torch.tensor([slot], dtype=torch.int32, device=device)
    a, bt = a.to(device, dtype), bt.to(device, dtype)
    bounds = tuple(int(v) for v in torch.tensor(sizes).cumsum(0)[:-1])
    got, lora = rms_norm_shrink(x, res, nw, 1e-5, slots, a, bt, bounds)
    if residual:
        want = fused_add_rms_norm(x, res, nw, 1e-5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        y = got[0]
    else:
        want = rms_norm(x, nw, 1e-5)
        assert torch.equal(got, want)
        y = got
    out = gemv(y, w, lora=lora).float().cpu()
    ref = (gemv(y, w).float().cpu()
           + lora_ref(y.float().cpu(), slots.cpu(), a.float().cpu(), bt.float().cpu()))
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # one more rounding to dtype
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if slot < 0:
        assert torch.equal(gemv(y, w, lora=lora), gemv(y, w))
    else:
        assert (out - gemv(y, w).float().cpu()).abs().max().item() > 1e-2
