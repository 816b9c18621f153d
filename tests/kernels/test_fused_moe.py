"""The Triton fused-MoE kernels against the torch reference (``layers/fused_moe``), both
paths (the decode GEMVs and the sorted grouped GEMMs), with uneven expert loads: experts
that get no tokens, one expert that gets every token, top-1 and top-k, sizes that do not
fill the tiles; ``moe_align`` against a direct sort (one and several chunks); and the
reference against a direct per-token sum."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from kernel_refs import DEVICE

from pagedllm.kernels.fused_moe import fused_experts, moe_align, use_decode_path
from pagedllm.layers.fused_moe import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref


def _weights(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=g) * i ** -0.5
    return w13.to(DEVICE), w2.to(DEVICE)


def _per_token(x, w13, w2, weights, ids):  # the definition, one token at a time
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _routing(kind: str, t: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if kind == "one_expert_takes_all":  # expert 2 is everyone's first choice
        logits[:, 2] += 100.0
    elif kind == "half_idle":  # experts >= e/2 never chosen (k <= e/2)
        logits[:, e // 2:] -= 100.0
    return select_experts(logits.to(DEVICE), k, renormalize=True)


@pytest.mark.parametrize("kind", ["random", "one_expert_takes_all", "half_idle"])
@pytest.mark.parametrize("path,t,e,k,h,i", [
    ("decode", 1, 8, 2, 64, 96), ("decode", 4, 16, 3, 32, 40),
    ("sorted", 1, 8, 2, 64, 96), ("sorted", 37, 8, 1, 48, 80), ("sorted", 70, 16, 3, 32, 40)])
def test_kernel_matches_reference(kind: str, path: str, t: int, e: int, k: int, h: int,
                                  i: int) -> None:
    w13, w2 = _weights(e, h, i, seed=t + e)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    weights, ids = _routing(kind, t, e, k, seed=e)
    if kind == "one_expert_takes_all" and k == 1:
        assert bool((ids == 2).all())
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    got = fused_experts(x, w13, w2, weights, ids, path=path)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_sorted_path_grouped_block_order() -> None:
    """GROUP_M > 1 (blocks taken in bands per feature tile, the last band ragged), larger
    M tiles and K tiles that do not divide H or I: same result as the reference."""
    from pagedllm.kernels.fused_moe import fused_experts_sorted

    w13, w2 = _weights(16, 48, 40, seed=9)
    x = torch.randn(70, 48, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    weights, ids = _routing("random", 70, 16, 3, seed=9)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    got = fused_experts_sorted(x, w13, w2, weights, ids, config=(32, 32, 32, 3, 4, 3))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_kernel_half_precision(path: str) -> None:
    """fp16 activations and weights (the interpreter's bf16 tl.dot is broken; the GPU
    tests below run bf16): the low-precision stores and the fp32 accumulation."""
    w13, w2 = _weights(8, 32, 48, seed=2)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = _routing("half_idle", 3, 8, 2, seed=2)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    got = fused_experts(x.half(), w13.half(), w2.half(), weights, ids, path=path)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, atol=3e-3, rtol=3e-3)


def test_auto_path_choice() -> None:
    """Decode while pairs are few and at most one per expert on average, sorted after;
    a bad ``path`` is a ValueError naming it."""
    assert use_decode_path(8, 128) and use_decode_path(64, 128)
    assert not use_decode_path(65, 128) and not use_decode_path(16, 8)
    w13, w2 = _weights(4, 16, 16, seed=0)
    x = torch.randn(2, 16).to(DEVICE)
    weights, ids = _routing("random", 2, 4, 2, seed=0)
    with pytest.raises(ValueError, match="path"):
        fused_experts(x, w13, w2, weights, ids, path="gemv")


def test_reference_is_the_per_token_sum() -> None:
    w13, w2 = _weights(5, 16, 24, seed=1)
    x = torch.randn(9, 16).to(DEVICE)
    weights, ids = _routing("half_idle", 9, 5, 2, seed=3)
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids),
                               _per_token(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def _align_ref(ids: torch.Tensor, e: int, bm: int) -> tuple[list[int], list[int]]:
    """(sorted ids up to the padded total, expert of each block), by a direct loop."""
    flat = ids.reshape(-1).tolist()
    out: list[int] = []
    blocks: list[int] = []
    for ex in range(e):
        run = [p for p, v in enumerate(flat) if v == ex]
        padded = -(-len(run) // bm) * bm
        out += run + [len(flat)] * (padded - len(run))
        blocks += [ex] * (padded // bm)
    return out, blocks


@pytest.mark.parametrize("kind,t,e,k,bm", [
    ("random", 50, 512, 4, 16),  # 200 pairs in chunks of 64: four chunks
    ("one_expert_takes_all", 40, 512, 2, 8), ("half_idle", 33, 16, 3, 32),
    ("random", 1, 128, 8, 16)])
def test_align_matches_direct_sort(kind: str, t: int, e: int, k: int, bm: int) -> None:
    _, ids = _routing(kind, t, e, k, seed=t)
    sorted_ids, block_expert, num_padded = moe_align(ids, e, block_m=bm)
    ref, blocks = _align_ref(ids, e, bm)
    assert int(num_padded) == len(ref)
    assert sorted_ids[:len(ref)].tolist() == ref
    assert block_expert[:len(blocks)].tolist() == blocks
    assert sorted_ids.numel() >= len(ref) and block_expert.numel() * bm == sorted_ids.numel()


def test_align_pads_each_expert_to_the_block() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]], device=DEVICE)  # expert 2 idle
    sorted_ids, block_expert, num_padded = moe_align(ids, 4, block_m=4)
    # Expert 0: pairs 1, 5; expert 1: pair 3; expert 3: pairs 0, 2, 4 (6 = padding).
    assert int(num_padded) == 12
    assert sorted_ids[:12].tolist() == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]
    assert block_expert[:3].tolist() == [0, 1, 3]


_REAL_WEIGHTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "sorted"])
@pytest.mark.parametrize("shape,t", [("qwen3", 1), ("qwen3", 8), ("qwen3", 64),
                                     ("qwen3", 1024), ("mixtral", 1), ("mixtral", 4),
                                     ("mixtral", 300)])
def test_kernel_bf16_real_shape(shape: str, t: int, path: str) -> None:
    """Qwen3-30B-A3B's expert shape (128 experts, top-8, H 2048, I 768) and Mixtral's
    (8 experts, top-2, H 4096, I 14336) in bf16, both paths."""
    e, k, h, i = (128, 8, 2048, 768) if shape == "qwen3" else (8, 2, 4096, 14336)
    if shape not in _REAL_WEIGHTS:  # made on the device, once per shape
        _REAL_WEIGHTS.clear()
        g = torch.Generator(device=DEVICE).manual_seed(0)
        _REAL_WEIGHTS[shape] = tuple(
            (torch.randn(*dims, device=DEVICE, generator=g) * dims[2] ** -0.5).bfloat16()
            for dims in ((e, 2 * i, h), (e, h, i)))
    w13, w2 = _REAL_WEIGHTS[shape]
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing("random", t, e, k, seed=1)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_experts(x, w13, w2, weights, ids, path=path).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 40])
def test_cuda_graph_replays_new_routing(t: int) -> None:
    """Captured once, replayed with other routing in the same buffers: equals eager (no
    host sync, no shape taken from the data), on both paths (t * k = 8 and 160)."""
    e, k, h, i = 64, 4, 256, 128
    w13, w2 = (w.to(torch.bfloat16) for w in _weights(e, h, i, seed=4))
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing("random", t, e, k, seed=5)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for kind in ("one_expert_takes_all", "half_idle"):
        new_w, new_ids = _routing(kind, t, e, k, seed=6)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, weights, ids))


@pytest.mark.parametrize("e,k,renorm", [(16, 3, True), (128, 8, False), (8, 1, True)])
def test_fused_topk_matches_select_experts(e: int, k: int, renorm: bool) -> None:
    """The one-launch routing kernel (used on CUDA) against the torch steps: same experts
    in the same order, weights within float32 rounding.  (Exact ties, which bf16 logits
    can have, go to the lower expert id; torch.topk leaves their order unspecified.)"""
    from pagedllm.kernels.moe_routing import fused_topk

    logits = torch.randn(6, e, generator=torch.Generator().manual_seed(e)).to(DEVICE)
    ref_w, ref_ids = select_experts(logits, k, renorm)
    got_w, got_ids = fused_topk(logits, k, renorm)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, atol=1e-6, rtol=1e-5)


_DECODE_CONFIGS = [  # (gate-up BN, BK, warps, down BN, BK, warps, all slots)
    (4, 64, 4, 2, 32, 4, False),    # the slot loop, K steps that divide H / I
    (2, 128, 2, 4, 64, 2, True),    # all slots, whole rows (I = 48: masked columns)
    (8, 32, 4, 1, 16, 8, True),     # all slots, several K steps, one feature each
    (8, 64, 4, 2, 32, 8, True),     # all slots, K steps with a masked last (I = 48)
]


# Each variant in fp32 and bf16, with top-k a power of two and not (3: padding slots),
# T = 1 and T > 1; T and the expert counts spread over the variants (the full product,
# 24 cases, took ~2 minutes under the interpreter for no more code paths).
_DECODE_CASES = [  # (config index, dtype, T, E, top-k)
    (0, torch.float32, 1, 16, 8), (0, torch.bfloat16, 2, 12, 3),
    (0, torch.float32, 8, 8, 2),
    (1, torch.float32, 2, 12, 3), (1, torch.bfloat16, 8, 8, 2),
    (2, torch.float32, 5, 16, 4), (2, torch.bfloat16, 1, 16, 8),
    (2, torch.bfloat16, 2, 12, 3),
    (3, torch.float32, 1, 16, 6), (3, torch.bfloat16, 4, 12, 6),  # DeepSeek's top-6
]


@pytest.mark.parametrize("ci,dtype,t,e,k", _DECODE_CASES)
def test_decode_configs_match_reference(ci: int, dtype: torch.dtype, t: int, e: int,
                                        k: int) -> None:
    """Every decode-path variant the sweep may pick (``DecodeConfig``), T = 1..8, top-k
    both a power of two and not (padding slots), with uneven routing across tokens (one
    expert in every token's top-k, experts left idle), fp32 and bf16."""
    from pagedllm.kernels.fused_moe_configs import DecodeConfig
    from pagedllm.kernels.fused_moe_decode import fused_experts_decode

    cfg = _DECODE_CONFIGS[ci]
    h, i = 64, 48
    w13, w2 = _weights(e, h, i, seed=t * e + k)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    weights, ids = _routing("one_expert_takes_all", t, e, k, seed=k)
    assert bool((ids == 2).any(dim=1).all())  # several tokens share expert 2
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    w13, w2, x = w13.to(dtype), w2.to(dtype), x.to(dtype)
    if dtype == torch.bfloat16:  # the reference on the same rounded inputs
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_experts_decode(x, w13, w2, weights, ids, config=DecodeConfig(*cfg))
    assert got is not None and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: act and out rounded
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


_COMPILE_DECODE = textwrap.dedent(r"""
    import json
    import triton
    from tests.kernels.sm90_compile import compile_sm90
    from pagedllm.kernels import fused_moe_decode as D

    i32, out = "i32", {}
    gate_up_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64",
                   "act_ptr": "*bf16", "logits_ptr": "*bf16", "stride_xt": i32,
                   "stride_we": i32, "stride_wn": i32, "stride_ap": i32, "stride_lt": i32}
    loop_sig = {"act_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64",
                "weights_ptr": "*fp32", "out_ptr": "*bf16", "stride_ap": i32,
                "stride_we": i32, "stride_wn": i32, "stride_ot": i32}
    slots_sig = {**{n: v for n, v in loop_sig.items() if not n.startswith("stride")},
                 "logits_ptr": "*bf16",
                 **{n: v for n, v in loop_sig.items() if n.startswith("stride")},
                 "stride_lt": i32}
    # Each shape's config at T = 1 and at the decode path's largest T; Qwen3's routed.
    for name, e, k, h, i, t, routed in [
            ("qwen3", 128, 8, 2048, 768, 1, False), ("qwen3", 128, 8, 2048, 768, 8, False),
            ("qwen3 routed", 128, 8, 2048, 768, 1, True),
            ("mixtral", 8, 2, 4096, 14336, 1, False),
            ("mixtral", 8, 2, 4096, 14336, 4, False),
            ("deepseek-v2-lite", 64, 6, 2048, 1408, 1, True),
            ("deepseek-v2-lite", 64, 6, 2048, 1408, 8, False)]:
        c = D.get_decode_config(t, e, i, h) or D.default_decode_config(t, k, i, h)
        route = dict(ROUTED=routed, NUM_EXPERTS=e if routed else 1,
                     E_P2=triton.next_power_of_2(e) if routed else 1)
        shape = dict(TOP_K=k, HIDDEN=h, INTER=i, USE_PDL=True)
        opts = {"launch_pdl": True}
        out[f"{name} T={t} gate-up"] = compile_sm90(
            D._decode_gate_up_kernel, gate_up_sig,
            dict(shape, **route, BLOCK_N=c.gate_up_block_n, BLOCK_K=c.gate_up_block_k),
            dict(opts, num_warps=c.gate_up_warps), list(range(10)))[1]
        consts = dict(shape, BLOCK_N=c.down_block_n, BLOCK_K=c.down_block_k)
        kernel, sig = D._decode_down_kernel, loop_sig
        if c.down_all_slots:
            kernel, sig = D._decode_down_slots_kernel, slots_sig
            consts.update(route, K_P2=triton.next_power_of_2(k), RENORMALIZE=True)
        out[f"{name} T={t} down"] = compile_sm90(
            kernel, sig, consts, dict(opts, num_warps=c.down_warps),
            list(range(len(sig))))[1]
    print(json.dumps(out))
""")


def test_decode_kernels_compile_for_sm90_without_spills(tmp_path) -> None:
    """The decode path's kernels at the configs the real shapes run (``DECODE_CONFIGS``
    or the heuristic), compiled for sm_90 without a GPU: no register spills (a spilled
    GEMV streams its weights through local memory)."""
    from tests.kernels.sm90_compile import run_script

    stats = run_script(_COMPILE_DECODE, tmp_path)
    assert len(stats) == 14, stats
    assert not any(s["spill_stores"] for s in stats.values()), stats


@pytest.mark.parametrize("t,e,k,renorm,dtype", [  # each shape once, both dtypes
    (1, 16, 8, True, torch.float32), (3, 12, 3, False, torch.bfloat16),
    (8, 16, 2, True, torch.bfloat16)])
def test_routed_decode_matches_select_experts(t: int, e: int, k: int, renorm: bool,
                                              dtype: torch.dtype) -> None:
    """Routing inside the decode kernels (``fused_experts_routed``) equals the routing
    launch (``fused_topk``) then the reference: T = 1..8, k a power of two and not,
    with and without renormalisation, bf16 router logits with exact ties (expert 1
    ties expert 5 in every token, both in its top-k: the lower id first, as
    ``fused_topk``), several tokens on one expert."""
    from pagedllm.kernels.fused_moe import fused_experts_routed
    from pagedllm.kernels.moe_routing import fused_topk

    w13, w2 = _weights(e, 32, 24, seed=e + k)
    g = torch.Generator().manual_seed(t * 7 + k)
    x = torch.randn(t, 32, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 1] = logits[:, 5] = logits.max(dim=1).values + 1.0  # a tie, chosen
    logits[:, 2] += 3.0  # expert 2 in every token's top-k
    logits = logits.to(dtype)
    weights, ids = fused_topk(logits.to(DEVICE), k, renorm)  # checked against torch above
    ref = fused_experts_ref(x.to(dtype).float().to(DEVICE), w13.to(dtype).float().to(DEVICE),
                            w2.to(dtype).float().to(DEVICE), weights, ids)
    got = fused_experts_routed(x.to(dtype).to(DEVICE), w13.to(dtype), w2.to(dtype),
                               logits.to(DEVICE), k, renorm)
    assert got is not None and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_routed_decode_only_where_it_applies() -> None:
    """None (the caller routes with ``select_experts``) for sorted-path batches, more
    experts than the in-kernel top-k holds, and a bad top-k."""
    from pagedllm.kernels.fused_moe import fused_experts_routed

    w13, w2 = _weights(8, 16, 16, seed=0)
    x = torch.randn(40, 16).to(DEVICE)
    assert fused_experts_routed(x, w13, w2, torch.randn(40, 8).to(DEVICE), 2, True) is None
    assert fused_experts_routed(x[:1], w13, w2, torch.randn(1, 8).to(DEVICE), 9,
                                True) is None
    big = torch.zeros(256, 32, 16, device=DEVICE), torch.zeros(256, 16, 16, device=DEVICE)
    assert fused_experts_routed(x[:1], *big, torch.randn(1, 256).to(DEVICE), 2,
                                True) is None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_routed_decode_bf16_real_shape_graphed(t: int) -> None:
    """Qwen3-30B-A3B's shape in bf16: routing inside the decode kernels against the
    routing launch plus the fp32 reference; captured once and replayed with new logits
    in the same buffer, bit-identical to eager (no atomics: the same bits every run).
    The shape's tuned config does not route in-kernel (the sweep timed it slower), so
    the test forces it: the kernels must still be right where a table turns it on."""
    from pagedllm.kernels.fused_moe_decode import decode_config, fused_moe_decode_routed

    e, k, h, i = 128, 8, 2048, 768
    g = torch.Generator(device=DEVICE).manual_seed(3)
    w13 = (torch.randn(e, 2 * i, h, device=DEVICE, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=DEVICE, generator=g) * i ** -0.5).bfloat16()
    x = torch.randn(t, h, device=DEVICE, generator=g).bfloat16()
    logits = torch.randn(t, e, device=DEVICE, generator=g).bfloat16()
    weights, ids = select_experts(logits, k, renormalize=True)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    cfg = decode_config(t, k, w13, w2)._replace(down_all_slots=True, route_in_kernel=True)

    def routed() -> torch.Tensor:
        out = fused_moe_decode_routed(x, w13, w2, logits, k, True, cfg)
        assert out is not None
        return out

    got = routed()
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed()
    for seed in (4, 5):
        logits.copy_(torch.randn(t, e, device=DEVICE,
                                 generator=torch.Generator(device=DEVICE).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, routed())
        assert torch.equal(out, routed())
