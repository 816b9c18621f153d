"""DeepSeekMoE (``models/deepseek_moe.py``) against transformers' own blocks in float32:
``DeepseekV2Moe`` (greedy and group-limited softmax routing) and ``DeepseekV3MoE``
(sigmoid, correction bias, top-2-sum groups, ``norm_topk_prob``) with random weights
loaded through ``deepseek_moe_weight_target`` -- per-expert names (what
``save_pretrained`` writes and released checkpoints use) and transformers' fused banks --
for random inputs, grouped configs and ``routed_scaling_factor != 1``.  The routing
itself must equal transformers' router bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from pagedllm.layers.fused_moe.routing import GroupedTopK, grouped_topk
from pagedllm.layers.linear import load_weight
from pagedllm.models.deepseek_moe import DeepseekMoE, deepseek_moe_weight_target

H, INTER = 32, 16
PREFIX = "model.layers.3.mlp"

V2 = [  # (topk_method, n_group, topk_group, experts, top_k, scaling, shared)
    ("greedy", None, None, 8, 3, 1.0, 2),
    ("group_limited_greedy", 4, 2, 8, 3, 2.5, 1),
    ("group_limited_greedy", 2, 1, 6, 2, 16.0, 2),
    ("group_limited_greedy", 3, 1, 12, 4, 1.0, 1),
]
V3 = [  # (n_group, topk_group, experts, top_k, norm_topk_prob, scaling, shared)
    (4, 2, 16, 4, True, 2.5, 1),
    (2, 1, 8, 3, False, 1.5, 2),
    (1, 1, 8, 2, True, 2.446, 1),  # Moonlight: one group
    (4, 1, 12, 2, True, 1.0, 1),
]


def _v2(method: str, n_group: Any, topk_group: Any, e: int, k: int, scale: float,
        shared: int) -> Any:
    return transformers.DeepseekV2Config(
        hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=e,
        num_experts_per_tok=k, n_shared_experts=shared, topk_method=method,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)


def _v3(n_group: int, topk_group: int, e: int, k: int, norm: bool, scale: float,
        shared: int) -> Any:
    return transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=e,
        num_experts_per_tok=k, n_shared_experts=shared, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)


def _randomize(hf: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            # The bias is on the scale of the sigmoid scores, so it changes the choice.
            scale = 0.3 if "bias" in name else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _checkpoint(hf: torch.nn.Module, fused: bool) -> dict[str, torch.Tensor]:
    """The block's tensors under checkpoint names: per expert (as ``save_pretrained``
    writes them) or transformers' in-memory fused banks."""
    sd = dict(hf.state_dict())
    out = {f"{PREFIX}.{n}": t for n, t in sd.items() if not n.startswith("experts.")}
    if fused:
        out[f"{PREFIX}.experts.gate_up_proj"] = sd["experts.gate_up_proj"]
        out[f"{PREFIX}.experts.down_proj"] = sd["experts.down_proj"]
        return out
    for e in range(sd["experts.gate_up_proj"].shape[0]):
        gate, up = sd["experts.gate_up_proj"][e].chunk(2, dim=0)
        out[f"{PREFIX}.experts.{e}.gate_proj.weight"] = gate
        out[f"{PREFIX}.experts.{e}.up_proj.weight"] = up
        out[f"{PREFIX}.experts.{e}.down_proj.weight"] = sd["experts.down_proj"][e]
    return out


def _load(block: DeepseekMoE, ckpt: dict[str, torch.Tensor]) -> None:
    params = dict(block.named_parameters())
    seen = set()
    for name, tensor in ckpt.items():
        target = deepseek_moe_weight_target(name)
        assert target is not None, name
        pname, args = target
        pname = pname.removeprefix(PREFIX + ".")
        load_weight(params[pname], tensor, *args)
        seen.add(pname)
    assert seen == set(params), set(params) - seen


def _pair(hf_cls: type, config: Any, seed: int, fused: bool
          ) -> tuple[torch.nn.Module, DeepseekMoE]:
    torch.manual_seed(0)
    hf = hf_cls(config).eval()
    _randomize(hf, seed)
    block = DeepseekMoE(config, prefix=PREFIX)
    _load(block, _checkpoint(hf, fused))
    return hf, block


def _check(hf: torch.nn.Module, block: DeepseekMoE, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 23, H, generator=g)
    with torch.no_grad():
        _, hf_w, hf_ids = hf.gate(x)
        w, ids = block.gate(x.view(-1, H))
        assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
        want = hf(x)
        got = block(x.view(-1, H)).view_as(want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", V2)
def test_v2_block_equals_transformers(case: tuple, fused: bool) -> None:
    hf, block = _pair(DeepseekV2Moe, _v2(*case), seed=len(str(case)), fused=fused)
    assert block.gate.e_score_correction_bias is None
    _check(hf, block, seed=1)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", V3)
def test_v3_block_equals_transformers(case: tuple, fused: bool) -> None:
    hf, block = _pair(DeepseekV3MoE, _v3(*case), seed=len(str(case)), fused=fused)
    assert block.gate.e_score_correction_bias is not None
    _check(hf, block, seed=2)


def test_v3_bias_selects_but_does_not_weigh() -> None:
    """A large bias on expert 0 puts it in every token's top-k, yet its weight is its
    unbiased score (so the bias must not leak into the weights)."""
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(8)
    bias[0] = 10.0
    params = GroupedTopK(scoring_func="sigmoid", num_expert_group=2, topk_group=1,
                         group_score="top2_sum")
    w, ids = grouped_topk(logits, 2, params, bias)
    assert (ids == 0).any(dim=-1).all()
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids), rtol=0, atol=0)
    assert (ids < 4).all()  # only expert 0's group survives topk_group=1


def test_saved_checkpoint_names_map(tmp_path) -> None:
    """What transformers 5.x ``save_pretrained`` writes for a tiny V3 model maps onto the
    block's parameters, and the loaded block equals the model's own layer."""
    from safetensors.torch import load_file

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=H, intermediate_size=48, moe_intermediate_size=INTER,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=4, topk_group=2,
        routed_scaling_factor=2.5)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    _randomize(hf.model.layers[1].mlp, seed=5)
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.1.mlp"
    ckpt = {n: t for n, t in tensors.items() if n.startswith(prefix + ".")}
    assert f"{prefix}.experts.7.down_proj.weight" in ckpt  # per-expert names on disk
    block = DeepseekMoE(config, prefix=prefix)
    params = dict(block.named_parameters())
    for name, t in ckpt.items():
        pname, args = deepseek_moe_weight_target(name)  # type: ignore[misc]
        load_weight(params[pname.removeprefix(prefix + ".")], t, *args)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf.model.layers[1].mlp(x[None])[0],
                                   rtol=1e-5, atol=1e-6)


def test_bad_routing_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="topk_group"):
        GroupedTopK(num_expert_group=2, topk_group=3)
    with pytest.raises(ValueError, match="scoring_func"):
        GroupedTopK(scoring_func="relu")
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk(torch.randn(2, 6), 2, GroupedTopK(num_expert_group=4, topk_group=1))
    with pytest.raises(ValueError, match="topk_method"):
        DeepseekMoE(_v2("weird", None, None, 4, 2, 1.0, 1))
