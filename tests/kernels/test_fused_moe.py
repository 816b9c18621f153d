"""The Triton fused-MoE kernels against the torch reference (``layers/fused_moe``), with
uneven expert loads: experts that get no tokens, one expert that gets every token,
top-1 and top-k, sizes that do not fill the tiles; and the reference against a direct
per-token sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_refs import DEVICE

from pagedllm.kernels.fused_moe import fused_experts, moe_align
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
@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 96), (37, 8, 1, 48, 80),
                                       (70, 16, 3, 32, 40)])
def test_kernel_matches_reference(kind: str, t: int, e: int, k: int, h: int, i: int) -> None:
    w13, w2 = _weights(e, h, i, seed=t + e)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    weights, ids = _routing(kind, t, e, k, seed=e)
    if kind == "one_expert_takes_all" and k == 1:
        assert bool((ids == 2).all())
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_per_token_sum() -> None:
    w13, w2 = _weights(5, 16, 24, seed=1)
    x = torch.randn(9, 16).to(DEVICE)
    weights, ids = _routing("half_idle", 9, 5, 2, seed=3)
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids),
                               _per_token(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_align_pads_each_expert_to_the_block() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]], device=DEVICE)  # expert 2 idle
    sorted_ids, block_expert, num_padded = moe_align(ids, 4, block_m=4)
    # Expert 0: pairs 1, 5; expert 1: pair 3; expert 3: pairs 0, 2, 4 (6 = padding).
    assert int(num_padded) == 12
    assert sorted_ids[:12].tolist() == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]
    assert block_expert[:3].tolist() == [0, 1, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 1024])
def test_kernel_bf16_real_shape(t: int) -> None:
    """Qwen3-30B-A3B's expert shape (128 experts, top-8, H 2048, I 768) in bf16."""
    e, k, h, i = 128, 8, 2048, 768
    w13, w2 = (w.to(torch.bfloat16) for w in _weights(e, h, i, seed=0))
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing("random", t, e, k, seed=1)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_experts(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
