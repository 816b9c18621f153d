"""The INT4/INT8 weight-only GEMM (``kernels/wna16.py``) against its torch reference, and
the reference and packing against first principles.

Interpreter cases: bits 4 and 8; symmetric and with zero points; with and without an
act-order ``g_idx`` (a random permutation of the inputs over the groups); M in 1, 3, 17,
64 (the GEMV, the 16-row decode tile, the tiled path); K a multiple of the K step and not;
group sizes that do and do not hold whole K steps, and channel-wise (-1); fp32, fp16,
bf16.  The bound is derived, not tuned: fp32 accumulation, the dequantised weight rounded
to the activation dtype before ``tl.dot``, one rounding of the output (truncation for
bf16 in the interpreter).  GPU cases (marked ``gpu``) run the Llama-3-8B projections."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_refs import DEVICE, fresh_seed

from pagedllm.kernels.wna16 import (
    dequantize,
    pack_codes,
    unpack_codes,
    wna16_gemm,
    wna16_ref,
)

# Relative error of rounding the dequantised weight (tl.dot operand) and the output.
EPS_W = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
EPS_OUT = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def make_weight(n: int, k: int, bits: int, group_size: int, *, zeros: bool, act_order: bool,
                dtype: torch.dtype, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                           torch.Tensor | None]:
    """Random codes, scales (~1/sqrt(k) per code step), zero points in code units and an
    act-order ``g_idx`` in the canonical layout, made on ``gen``'s device."""
    dev = gen.device
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, device=dev)
    scales = (torch.rand(n, groups, generator=gen, device=dev) + 0.5) \
        * (2.0 / (1 << bits)) / k ** 0.5
    zp = None
    if zeros:
        zp = torch.randint(0, 1 << bits, (n, groups), generator=gen, device=dev).float()
    g_idx = None
    if act_order:  # GPTQ act-order: group k // G of a permutation of the inputs
        perm = torch.randperm(k, generator=gen, device=dev)
        g_idx = (torch.argsort(perm) // g).to(torch.int32)
    return pack_codes(codes, bits), scales.to(dtype), zp, g_idx


def check_against_reference(x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                            bits: int, group_size: int, seed: int,
                            config: tuple[int, ...] | None = None) -> None:
    k = x.shape[-1]
    got = wna16_gemm(x, qw, scales, zeros, g_idx, bits, group_size, config=config)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], qw.shape[0])
    # fp64 on the tensors' device (a GPU does the 2048-row products in milliseconds).
    w = dequantize(qw, scales, zeros, g_idx, bits, group_size, k).double()
    xd = x.double()
    ref = xd @ w.T
    abs_sum = xd.abs() @ w.abs().T
    got = got.double()
    assert not got.isnan().any(), f"NaN / unwritten outputs (seed={seed})"
    bound = (2e-5 + EPS_W[x.dtype]) * abs_sum + EPS_OUT[x.dtype] * ref.abs() + 1e-6
    excess = ((got - ref).abs() - bound).max().item()
    assert excess <= 0, (f"max abs err {(got - ref).abs().max().item():.3g} exceeds the "
                         f"bound by {excess:.3g} (seed={seed}, config={config})")
    # The public reference agrees with the fp64 product the same way.
    ref_fn = wna16_ref(x.float(), qw, scales, zeros, g_idx, bits, group_size).double()
    assert ((ref_fn - ref).abs() <= 2e-6 * abs_sum + 1e-6).all()


# (N, K, group_size): ragged K with groups of 40; K = 256 with groups that hold whole
# 64/128-wide K steps; channel-wise scales on a ragged K.
SHAPES = [(48, 200, 40), (40, 256, 128), (36, 256, 64), (24, 136, -1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_matches_reference(bits: int, m: int) -> None:
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    # Every (zeros, act-order) pair, dtypes and shapes in turn (over the parameters,
    # each dtype meets each pair and each shape; all of them would triple the time).
    for i, (zeros, act_order) in enumerate(itertools.product([False, True], repeat=2)):
        dtype = DTYPES[(i + m + bits) % len(DTYPES)]
        n, k, g = SHAPES[(i + m // 2) % len(SHAPES)]
        qw, s, z, gi = make_weight(n, k, bits, g, zeros=zeros, act_order=act_order,
                                   dtype=dtype, gen=gen)
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
        check_against_reference(x, qw, s, z, gi, bits, g, seed)


@pytest.mark.parametrize("config", [
    (16, 32, 64, 4, 1, 1),  # the dot path at one row, no split
    (1, 16, 64, 4, 1, 3),  # the GEMV at several rows, uneven split (last one masked)
    (32, 16, 128, 4, 1, 2),  # a K step wider than the group
])
def test_wna16_launch_variants(config: tuple[int, ...]) -> None:
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    qw, s, z, gi = make_weight(40, 200, 4, 40, zeros=True, act_order=True,
                               dtype=torch.float16, gen=gen)
    x = torch.randn(2, 1, 200, generator=gen, device=DEVICE).to(torch.float16)  # 3-D x
    check_against_reference(x, qw, s, z, gi, 4, 40, seed, config=config)
    # Groups of 32 without g_idx: one group per K step (block_k 32) or whole groups in
    # one (64, 128), the last one ragged.
    qw, s, z, gi = make_weight(40, 200, 8, 32, zeros=True, act_order=False,
                               dtype=torch.float16, gen=gen)
    check_against_reference(x, qw, s, z, gi, 8, 32, seed, config=config)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_layout_is_little_endian_in_the_word(bits: int) -> None:
    """Each word equals sum(code_j << j * bits) over its 32 / bits codes, computed with
    Python ints; unpacking inverts packing."""
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=gen)
    packed = pack_codes(codes, bits)
    per = 32 // bits
    assert packed.shape == (3, 64 // per) and packed.dtype == torch.int32
    for n in range(3):
        for w in range(64 // per):
            word = sum(int(codes[n, w * per + j]) << (j * bits) for j in range(per))
            assert int(packed[n, w]) & 0xFFFFFFFF == word
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.int32))


@pytest.mark.parametrize("bits,zeros", [(4, False), (8, True)])
def test_reference_dequantises_a_round_to_nearest_weight(bits: int, zeros: bool) -> None:
    """Quantise a float weight by round-to-nearest per group (act-order permuted), pack
    it, and the reference's weight is within half a step of the original."""
    gen = torch.Generator().manual_seed(7)
    n, k, g = 8, 64, 16
    w = torch.randn(n, k, generator=gen)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // g).to(torch.int32)
    qmax = (1 << bits) - 1
    lo = torch.stack([w[:, g_idx == j].amin(1) for j in range(k // g)], 1)
    hi = torch.stack([w[:, g_idx == j].amax(1) for j in range(k // g)], 1)
    if zeros:
        scale = (hi - lo) / qmax
        zero = torch.round(-lo / scale)
    else:
        scale = torch.maximum(hi.abs(), lo.abs()) / (qmax // 2)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    gl = g_idx.long()
    codes = torch.clamp(torch.round(w / scale[:, gl]) + zero[:, gl], 0, qmax)
    qw = pack_codes(codes.to(torch.int64), bits)
    deq = dequantize(qw, scale, zero if zeros else None, g_idx, bits, g)
    assert ((deq - w).abs() <= 0.5 * scale[:, gl] + 1e-6).all()
    x = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(wna16_ref(x, qw, scale, zero if zeros else None, g_idx,
                                         bits, g), x @ deq.T)


def test_wna16_rejects_bad_arguments() -> None:
    gen = torch.Generator(DEVICE).manual_seed(0)
    qw, s, z, gi = make_weight(16, 64, 4, 32, zeros=True, act_order=True,
                               dtype=torch.float32, gen=gen)
    x = torch.randn(2, 64, device=DEVICE)
    cases = [
        (dict(bits=3), "bits"),
        (dict(x=torch.randn(2, 60, device=DEVICE)), "qweight"),
        (dict(x=torch.randn(2, 64, device=DEVICE).to(torch.int32)), "x"),
        (dict(qweight=qw.float()), "qweight"),
        (dict(scales=s[:, :1]), "scales"),
        (dict(zeros=z[:8]), "zeros"),
        (dict(g_idx=gi[:32]), "g_idx"),
        (dict(group_size=0), "group_size"),
        (dict(config=(16, 32, 48, 4, 1, 1)), "config"),
        (dict(config=(8, 32, 64, 4, 1, 1)), "config"),
        (dict(scales=s.to("meta")), "scales"),  # not on x's device
    ]
    for change, name in cases:
        args = dict(x=x, qweight=qw, scales=s, zeros=z, g_idx=gi, bits=4, group_size=32)
        args.update(change)
        with pytest.raises(ValueError, match=name):
            wna16_gemm(**args)
    with pytest.raises(ValueError, match="codes"):
        pack_codes(torch.full((2, 8), 16), 4)
    with pytest.raises(ValueError, match="codes"):
        pack_codes(torch.zeros(2, 6, dtype=torch.int64), 4)


# Llama-3-8B projections: fused qkv, o_proj, fused gate_up, down_proj.
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 2048])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_gpu_wna16_llama3_shapes(n: int, k: int, m: int) -> None:
    seed = fresh_seed()
    gen = torch.Generator(DEVICE).manual_seed(seed)
    for bits, zeros, act_order in [(4, False, False), (4, True, True), (8, False, True)]:
        qw, s, z, gi = make_weight(n, k, bits, 128, zeros=zeros, act_order=act_order,
                                   dtype=torch.bfloat16, gen=gen)
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        check_against_reference(x, qw, s, z, gi, bits, 128, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_wna16_cuda_graph_replay(m: int) -> None:
    """The split-K decode path inside a CUDA graph equals the eager result bitwise."""
    gen = torch.Generator(DEVICE).manual_seed(m)
    qw, s, z, gi = make_weight(4096, 4096, 4, 128, zeros=False, act_order=False,
                               dtype=torch.bfloat16, gen=gen)
    x = torch.randn(m, 4096, generator=gen, device=DEVICE).to(torch.bfloat16)
    eager = wna16_gemm(x, qw, s, z, gi, 4, 128)
    static = torch.zeros_like(x)
    wna16_gemm(static, qw, s, z, gi, 4, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wna16_gemm(static, qw, s, z, gi, 4, 128)
    static.copy_(x)
    graph.replay()
    assert torch.equal(out, eager)
