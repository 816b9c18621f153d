"""Expert parallelism at the layer level: ``FusedMoE`` split over EP=2 ranks equals the
unsplit layer, in process (each rank's partial sum, added by hand) and over a real gloo
group (two processes, ``init_parallel_state(expert_parallel=True)``, the all-reduce in
the layer) -- with random routing, one expert receiving no tokens, and every token
routed to one rank's experts (the other rank contributes zeros).  Over gloo the
DeepSeek-V3 block (routed experts EP-split, shared experts TP-sliced) equals
transformers' ``DeepseekV3MoE``."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.deepseek_moe import DeepseekMoE
from tests.models.test_deepseek_moe import _checkpoint, _randomize, _v3
from tests.models.test_deepseek_moe import _load as load_block

E, K, H, INTER, T = 8, 2, 32, 16, 19


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTER, H, generator=g) * 0.2,
            torch.randn(E, H, INTER, generator=g) * 0.2)


def _load(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
    for e in range(E):  # every expert offered; the layer keeps its own
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)


def _routings() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.rand(T, K, generator=g)
    rand = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    others = torch.tensor([e for e in range(E) if e != 5])
    no_expert_5 = torch.stack([others[torch.randperm(E - 1, generator=g)[:K]]
                               for _ in range(T)])
    rank0_only = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)])
    return {"random": (w, rand), "expert_5_idle": (w, no_expert_5),
            "all_on_rank_0": (w, rank0_only), "all_on_rank_1": (w, rank0_only + E // 2)}


def _reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    full = FusedMoE(E, K, H, INTER, renormalize=False)
    _load(full, *_weights())
    return {k: full.forward_topk(x, w, ids) for k, (w, ids) in _routings().items()}


def test_ep_partial_sums_add_up_in_process() -> None:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ranks = [FusedMoE(E, K, H, INTER, renormalize=False, ep_size=2, ep_rank=r)
             for r in range(2)]
    for layer in ranks:
        _load(layer, *_weights())
        assert layer.w13_weight.shape[0] == E // 2
    ref = _reference(x)
    for name, (w, ids) in _routings().items():
        parts = [layer.forward_topk(x, w, ids) for layer in ranks]
        torch.testing.assert_close(parts[0] + parts[1], ref[name], rtol=1e-5, atol=1e-6)
        if name == "all_on_rank_0":
            assert torch.equal(parts[1], torch.zeros_like(parts[1]))
    # Router logits path (select_experts, then the same split).
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    full = FusedMoE(E, K, H, INTER, renormalize=True)
    _load(full, *_weights())
    parts = []
    for layer in ranks:
        layer.renormalize = True
        parts.append(layer(x, logits))
    torch.testing.assert_close(parts[0] + parts[1], full(x, logits), rtol=1e-5, atol=1e-6)


def test_local_topk_on_the_triton_path_keeps_ids_in_range() -> None:
    layer = FusedMoE(E, K, H, INTER, renormalize=False, ep_size=2, ep_rank=1)
    w, ids = _routings()["random"]
    lw, lids = layer.local_topk(w, ids, skip_id=False)
    assert lids.min() >= 0 and lids.max() < E // 2
    mine = ids >= E // 2
    assert torch.equal(lw[~mine], torch.zeros_like(lw[~mine]))
    assert torch.equal(lids[mine], ids[mine] - E // 2) and torch.equal(lw[mine], w[mine])


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.getcwd())
    from pagedllm.distributed.parallel_state import (
        destroy_parallel_state,
        init_parallel_state,
        parallel_context,
    )

    state = init_parallel_state(2, 1, rank, f"tcp://127.0.0.1:{port}", "gloo", 60.0,
                                expert_parallel=True)
    try:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
        with parallel_context(state):
            layer = FusedMoE(E, K, H, INTER, renormalize=False)
            assert layer.num_local_experts == E // 2 and layer.expert_start == rank * E // 2
            _load(layer, *_weights())
            outs = {k: layer.forward_topk(x, w, ids) for k, (w, ids) in _routings().items()}
            cfg = _v3(4, 2, 16, 4, True, 2.5, 2)
            torch.manual_seed(0)
            hf = DeepseekV3MoE(cfg).eval()
            _randomize(hf, seed=9)
            block = DeepseekMoE(cfg, prefix="model.layers.3.mlp")
            assert block.experts.num_local_experts == 8
            load_block(block, _checkpoint(hf, fused=False))
            xb = torch.randn(17, H, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                outs["deepseek_v3_block"] = block(xb)
                outs["deepseek_v3_hf"] = hf(xb[None])[0]
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_parallel_state()


@pytest.mark.timeout(300)
def test_ep2_over_gloo_equals_ep1(tmp_path) -> None:
    from pagedllm.executor.multiproc import free_port

    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ref = _reference(x)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ref:  # every rank holds the all-reduced sum
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["deepseek_v3_block"], got["deepseek_v3_hf"],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_ep_rank_loads_and_reads_only_its_experts(rank: int, tmp_path) -> None:
    """A Mixtral rank built with an EP group of 2 holds experts ``[2r, 2r + 2)`` equal to
    the checkpoint's, and never reads another rank's expert tensors."""
    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.distributed.parallel_state import (
        GroupCoordinator,
        ParallelState,
        parallel_context,
    )
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.lazy_weight import ReadCounter
    from pagedllm.models.loader import load_model
    from tests.models.tiny_models import build

    hf = build("mixtral", str(tmp_path))
    cfg = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32").create_engine_config()
    group = GroupCoordinator(ranks=(0, 1), rank_in_group=rank)
    counter = ReadCounter()
    with parallel_context(ParallelState(rank=rank, world_size=2, tp=group, ep=group)):
        model = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend(),
                           read_counter=counter)
    experts = model.model.layers[0].mlp.experts
    assert experts.num_local_experts == 2 and experts.w13_weight.shape[0] == 2
    hf_experts = hf.model.layers[0].mlp.experts
    for local in range(2):
        e = 2 * rank + local
        torch.testing.assert_close(experts.w13_weight[local], hf_experts.gate_up_proj[e])
        torch.testing.assert_close(experts.w2_weight[local], hf_experts.down_proj[e])
    others = {2 * (1 - rank), 2 * (1 - rank) + 1}
    for name, nbytes in counter.read.items():
        if ".experts." in name:
            assert int(name.split(".experts.")[1].split(".")[0]) not in others or not nbytes


@pytest.mark.parametrize("name", ["random", "all_on_rank_0"])
def test_ep_split_on_the_triton_kernels(name: str) -> None:
    """The GPU path (Triton kernels; ``TRITON_INTERPRET=1`` on CPU): another rank's pairs
    become expert 0 with weight 0, which the sorted (19 tokens) and GEMV (2 tokens)
    paths both drop."""
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ref = _reference(x)[name]
    w, ids = _routings()[name]
    ranks = [FusedMoE(E, K, H, INTER, renormalize=False, ep_size=2, ep_rank=r)
             for r in range(2)]
    for layer in ranks:
        _load(layer, *_weights())
        layer.use_triton = True
    for t in (T, 2):
        parts = [layer.forward_topk(x[:t], w[:t], ids[:t]) for layer in ranks]
        torch.testing.assert_close(parts[0] + parts[1], ref[:t], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("serialized", [False, True])
def test_ep_split_with_fp8_experts(serialized: bool) -> None:
    """FP8 experts (quantised at load, or e4m3 checkpoints with their scales) split
    whole: each rank keeps its experts' weights and scales, and the partial sums add up
    to the unsplit FP8 layer."""
    from pagedllm.kernels.quant_common import quantize_fp8_rows
    from pagedllm.layers.quantization.fp8 import Fp8Config

    def load(layer: FusedMoE) -> None:
        w13, w2 = _weights()
        for e in range(E):
            for shard, m in (("w1", w13[e, :INTER]), ("w3", w13[e, INTER:]), ("w2", w2[e])):
                p = layer.w2_weight if shard == "w2" else layer.w13_weight
                if not serialized:
                    p.weight_loader(p, m, shard, e)
                    continue
                q, s = quantize_fp8_rows(m)
                ps = layer.w2_weight_scale if shard == "w2" else layer.w13_weight_scale
                p.weight_loader(p, q, shard, e)
                ps.weight_loader(ps, s, shard, e)
        layer.quant_method.process_weights_after_loading(layer)

    cfg = Fp8Config(serialized=serialized)
    full = FusedMoE(E, K, H, INTER, renormalize=False, quant_config=cfg)
    load(full)
    ranks = [FusedMoE(E, K, H, INTER, renormalize=False, ep_size=2, ep_rank=r,
                      quant_config=cfg) for r in range(2)]
    for layer in ranks:
        load(layer)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    for w, ids in _routings().values():
        parts = [layer.forward_topk(x, w, ids) for layer in ranks]
        torch.testing.assert_close(parts[0] + parts[1], full.forward_topk(x, w, ids),
                                   rtol=1e-5, atol=1e-6)
