"""Expert parallelism across data-parallel engines (``layers/fused_moe/dispatch.py``):
over real gloo groups, dp=2 engines of tp=1 and of tp=2 ranks (EP = 2 and 4), both
dispatch backends.  Each engine's output, on every one of its TP ranks, equals a
single-rank ``FusedMoE`` holding every expert run on that engine's tokens (float32,
tight tolerance) -- for different token counts per engine, an engine with zero tokens,
both idle, fewer tokens than TP ranks, every token routed to one rank's experts, an
expert no token chooses, the router-logits path and the Triton kernels (interpreted,
tp=1); the DeepSeek-V3 block (grouped
top-k, TP-sliced shared experts) and the Qwen2-MoE / Mixtral sparse block (shared
expert) equal their single-rank blocks; ``moe_dummy_pass`` on an idle engine serves the
other engine's tokens layer by layer.

The ranks write their outputs; the parent computes the references and compares (a rank
that asserted would leave the others blocked in a collective until the timeout)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator, ParallelState
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.fused_moe.dispatch import BACKENDS, make_dispatcher, spans_dp
from pagedllm.layers.linear import load_weight
from pagedllm.models.deepseek_moe import DeepseekMoE, deepseek_moe_weight_target
from pagedllm.models.moe import SparseMoeBlock

E, K, H, INTER = 8, 2, 32, 16
DP = 2
Case = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per engine: x, w, ids


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTER, H, generator=g) * 0.2,
            torch.randn(E, H, INTER, generator=g) * 0.2)


def _layer(seed: int, renormalize: bool = False) -> FusedMoE:
    """A ``FusedMoE`` built in the current parallel context, every expert offered (an
    EP rank keeps its own)."""
    layer = FusedMoE(E, K, H, INTER, renormalize=renormalize)
    w13, w2 = _weights(seed)
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    return layer


def _inputs(t: int, seed: int, choose: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t`` tokens routed to ``K`` distinct experts drawn from ``choose``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    w = torch.rand(t, K, generator=g)
    ids = torch.stack([choose[torch.randperm(len(choose), generator=g)[:K]]
                       for _ in range(t)]) if t else torch.empty(0, K, dtype=torch.int64)
    return x, w, ids


def _cases(ep: int) -> dict[str, Case]:
    every = torch.arange(E)
    first, last = torch.arange(E // ep), torch.arange(E - E // ep, E)
    if len(first) < K:  # fewer experts per rank than top_k: the first ranks' experts
        first, last = torch.arange(K), torch.arange(E - K, E)
    no_5 = torch.tensor([e for e in range(E) if e != 5])
    spec = {  # name: (tokens per engine, expert choice)
        "different_counts": ((19, 7), every), "engine_1_idle": ((13, 0), every),
        "engine_0_idle": ((0, 6), every), "both_idle": ((0, 0), every),
        "fewer_tokens_than_tp": ((1, 3), every), "all_on_first_rank": ((11, 5), first),
        "all_on_last_rank": ((4, 9), last), "expert_5_unused": ((9, 12), no_5)}
    return {name: [_inputs(t, 100 * i + d, choice) for d, t in enumerate(ts)]
            for i, (name, (ts, choice)) in enumerate(spec.items())}


def _logits(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + d)
    t = (10, 3)[d]
    return torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)


def _deepseek() -> tuple[Any, dict[str, torch.Tensor]]:
    """A DeepSeek-V3 config (16 experts in 4 groups, top-4, 2 shared experts) and a
    random checkpoint of its block, as ``test_expert_parallel`` builds them.  Made in the
    parent and handed to the ranks in a file: importing transformers' modelling code
    would cost each rank seconds."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from tests.models.test_deepseek_moe import _checkpoint, _randomize, _v3

    cfg = _v3(4, 2, 16, 4, True, 2.5, 2)
    torch.manual_seed(0)
    hf = DeepseekV3MoE(cfg).eval()
    _randomize(hf, seed=9)
    return cfg, _checkpoint(hf, fused=False)


DEEPSEEK_PREFIX = "model.layers.3.mlp"  # the prefix of test_deepseek_moe's checkpoints


def _deepseek_block(cfg: Any, ckpt: dict[str, torch.Tensor]) -> DeepseekMoE:
    block = DeepseekMoE(cfg, prefix=DEEPSEEK_PREFIX)
    params = dict(block.named_parameters())
    for name, tensor in ckpt.items():
        target = deepseek_moe_weight_target(name)
        assert target is not None, name
        load_weight(params[target[0].removeprefix(DEEPSEEK_PREFIX + ".")], tensor,
                    *target[1])
    return block


def _sparse_block() -> SparseMoeBlock:
    """Qwen2-MoE's block (Mixtral's plus a gated shared expert), random weights."""
    block = SparseMoeBlock(H, E, K, INTER, renormalize=False, shared_intermediate=2 * INTER)
    g = torch.Generator().manual_seed(21)
    w13, w2 = _weights(22)
    for e in range(E):
        block.experts.weight_loader(block.experts.w13_weight, w13[e, :INTER], "w1", e)
        block.experts.weight_loader(block.experts.w13_weight, w13[e, INTER:], "w3", e)
        block.experts.weight_loader(block.experts.w2_weight, w2[e], "w2", e)
    shared = block.shared_expert
    assert shared is not None
    load_weight(block.gate.weight, torch.randn(E, H, generator=g))
    load_weight(block.shared_expert_gate.weight, torch.randn(1, H, generator=g) * 0.2)
    for shard in (0, 1):
        load_weight(shared.gate_up_proj.weight, torch.randn(2 * INTER, H, generator=g) * 0.2,
                    shard)
    load_weight(shared.down_proj.weight, torch.randn(H, 2 * INTER, generator=g) * 0.2)
    return block


def _block_input(seed: int, t: int) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed))


BLOCK_TOKENS = (17, 6)


def _rank_main(proc: int, tp: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.getcwd())
    from pagedllm.distributed.parallel_state import (
        destroy_parallel_state,
        init_parallel_state,
        parallel_context,
    )
    from pagedllm.layers.fused_moe.dispatch import moe_dummy_pass

    d, rank = divmod(proc, tp)
    state = init_parallel_state(tp, 1, rank, f"tcp://127.0.0.1:{port}", "gloo", 60.0,
                                expert_parallel=True, dp_size=DP, dp_rank=d)
    outs: dict[str, Any] = {}
    deepseek = torch.load(os.path.join(out_dir, "deepseek.pt"), weights_only=False)
    cfg, ckpt = deepseek["cfg"], deepseek["ckpt"]
    try:
        with torch.no_grad():
            for backend in BACKENDS:
                with parallel_context(dataclasses.replace(state, all2all_backend=backend)):
                    layer = _layer(seed=0)
                    block = _deepseek_block(cfg, ckpt)
                    sparse = _sparse_block()
                    dummy_a = _layer(seed=1)
                    dummy_b = _deepseek_block(cfg, ckpt)
                outs[f"{backend}/dispatcher"] = type(layer.dispatcher).__name__
                outs[f"{backend}/local_experts"] = layer.num_local_experts
                for name, case in _cases(DP * tp).items():
                    outs[f"{backend}/{name}"] = layer.forward_topk(*case[d])
                if tp == 1:  # the GPU kernels (Triton interpreter): top-1, local ids
                    layer.use_triton = True
                    outs[f"{backend}/triton"] = layer.forward_topk(
                        *_cases(DP)["different_counts"][d])
                    layer.use_triton = False
                layer.renormalize = True
                outs[f"{backend}/logits"] = layer(*_logits(d))
                outs[f"{backend}/deepseek_v3"] = block(_block_input(d, BLOCK_TOKENS[d]))
                outs[f"{backend}/sparse_block"] = sparse(_block_input(d, BLOCK_TOKENS[d]))
                # Engine 1 is idle: its dummy pass meets engine 0's layers in order.
                model = nn.ModuleList([dummy_a, dummy_b])
                if d == 0:
                    x0, w0, ids0 = _cases(DP * tp)["different_counts"][0]
                    outs[f"{backend}/dummy_pass"] = dummy_b(dummy_a.forward_topk(x0, w0,
                                                                                 ids0))
                else:
                    moe_dummy_pass(model)
        torch.save(outs, os.path.join(out_dir, f"proc{proc}.pt"))
    finally:
        destroy_parallel_state()


def _references(cfg: Any, ckpt: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Single-rank outputs per engine (every expert on one rank, no groups)."""
    layer, block, sparse = _layer(seed=0), _deepseek_block(cfg, ckpt), _sparse_block()
    dummy_a, dummy_b = _layer(seed=1), _deepseek_block(cfg, ckpt)
    refs: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for tp in (1, 2):
            for name, case in _cases(DP * tp).items():
                refs[f"{name}@tp{tp}"] = [layer.forward_topk(*inp) for inp in case]
        x0, w0, ids0 = _cases(DP)["different_counts"][0]
        refs["dummy_pass"] = [dummy_b(dummy_a.forward_topk(x0, w0, ids0))]
        refs["deepseek_v3"] = [block(_block_input(d, t)) for d, t in enumerate(BLOCK_TOKENS)]
        refs["sparse_block"] = [sparse(_block_input(d, t))
                                for d, t in enumerate(BLOCK_TOKENS)]
        layer.renormalize = True
        refs["logits"] = [layer(*_logits(d)) for d in range(DP)]
    return refs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_dp2_dispatch_equals_one_rank(tp: int, tmp_path) -> None:
    from pagedllm.executor.multiproc import free_port

    cfg, ckpt = _deepseek()
    torch.save({"cfg": cfg, "ckpt": ckpt}, tmp_path / "deepseek.pt")
    mp.start_processes(_rank_main, args=(tp, free_port(), str(tmp_path)), nprocs=DP * tp,
                       join=True, start_method="spawn")
    refs = _references(cfg, ckpt)
    expected = {"allgather_reducescatter": "AllGatherReduceScatter", "alltoall": "AllToAll"}
    for proc in range(DP * tp):
        d = proc // tp
        got = torch.load(tmp_path / f"proc{proc}.pt")
        for backend in BACKENDS:
            assert got[f"{backend}/dispatcher"] == expected[backend]
            assert got[f"{backend}/local_experts"] == E // (DP * tp)
            for name in _cases(DP * tp):
                ref = refs[f"{name}@tp{tp}"][d]
                out = got[f"{backend}/{name}"]
                assert out.shape == ref.shape, (backend, name, proc)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, b=backend, n=name, p=proc:
                                           f"{b} {n} proc {p}: {m}")
            for name in ("logits", "deepseek_v3", "sparse_block"):
                torch.testing.assert_close(got[f"{backend}/{name}"], refs[name][d],
                                           rtol=1e-5, atol=1e-5,
                                           msg=lambda m, b=backend, n=name, p=proc:
                                           f"{b} {n} proc {p}: {m}")
            if tp == 1:
                torch.testing.assert_close(got[f"{backend}/triton"],
                                           refs["different_counts@tp1"][d],
                                           rtol=1e-4, atol=1e-5)
            if d == 0:
                torch.testing.assert_close(got[f"{backend}/dummy_pass"],
                                           refs["dummy_pass"][0], rtol=1e-5, atol=1e-5)


def test_dispatcher_choice() -> None:
    """A dispatcher only where the EP group spans DP engines; unknown backends are
    refused by name."""
    two = GroupCoordinator(ranks=(0, 1), rank_in_group=0)
    tp_only = ParallelState(rank=0, world_size=2, tp=two, ep=two)
    assert not spans_dp(tp_only) and make_dispatcher(tp_only) is None
    dp_ep = ParallelState(ep=two, dp=two)
    assert spans_dp(dp_ep)
    assert type(make_dispatcher(dp_ep)).__name__ == "AllGatherReduceScatter"
    assert make_dispatcher(dataclasses.replace(dp_ep, all2all_backend="alltoall")).name \
        == "alltoall"
    with pytest.raises(ValueError, match="all2all_backend"):
        make_dispatcher(dataclasses.replace(dp_ep, all2all_backend="deepep"))
