"""LoRA slots on the linear layers: tensor-parallel shards of A/B reassemble to the
unsharded delta (column-parallel shards B, row-parallel shards A), the hook works on a
quantised base method, and the slot manager's LRU never evicts an adapter in use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.worker.lora.layers import LoRALinear, LoRAMapping
from pagedllm.worker.lora.peft import LoRAWeights

R = 4


def _w(n_out: int, n_in: int, rank: int, g: torch.Generator, scale: float = 0.5
       ) -> LoRAWeights:
    return LoRAWeights(torch.randn(rank, n_in, generator=g),
                       torch.randn(n_out, rank, generator=g), scale)


def _delta(x: torch.Tensor, w: LoRAWeights | None, n_out: int) -> torch.Tensor:
    if w is None:
        return torch.zeros(x.shape[0], n_out)
    return w.scale * (x @ w.lora_a.T) @ w.lora_b.T


def _attach(layer, slots: torch.Tensor, shards) -> LoRALinear:
    m = LoRAMapping(16, torch.device("cpu"))
    m.token_slots[:len(slots)] = slots
    m.active = True
    lora = LoRALinear(layer, 2, R, m, torch.float32, torch.device("cpu"), use_triton=False)
    lora.set_slot(1, shards)
    layer.lora = lora
    return lora


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_and_gate_up_shards(tp: int) -> None:
    g = torch.Generator().manual_seed(tp)
    hidden, hd, nh, nkv = 16, 4, 4, 2
    q, k, v = (torch.randn(n * hd, hidden, generator=g) for n in (nh, nkv, nkv))
    lw = [_w(nh * hd, hidden, 3, g), None, _w(nkv * hd, hidden, R, g)]  # k untouched
    x = torch.randn(5, hidden, generator=g)
    slots = torch.tensor([1, -1, 1, 1, -1], dtype=torch.int32)  # -1: base model rows
    on = (slots >= 0).float()[:, None]
    outs = []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, hd, nh, nkv, tp_size=tp, tp_rank=rank)
        for sid, w in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, w, sid)
        _attach(layer, slots, lw)
        outs.append(layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=1))
    for i, (full, w) in enumerate(zip((q, k, v), lw)):
        want = x @ full.T + on * _delta(x, w, full.shape[0])
        torch.testing.assert_close(torch.cat([o[i] for o in outs], 1), want)

    gate, up = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    lw2 = [_w(8, 6, R, g), _w(8, 6, 2, g)]
    x2 = torch.randn(5, 6, generator=g)
    parts = []
    for rank in range(tp):
        gu = MergedColumnParallelLinear(6, [8, 8], tp_size=tp, tp_rank=rank)
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        _attach(gu, slots, lw2)
        parts.append(gu(x2).chunk(2, dim=1))
    for i, (full, w) in enumerate(zip((gate, up), lw2)):
        want = x2 @ full.T + on * _delta(x2, w, 8)
        torch.testing.assert_close(torch.cat([p[i] for p in parts], 1), want)


@pytest.mark.parametrize("tp", [1, 2])
def test_row_parallel_partials_sum_to_the_delta(tp: int) -> None:
    g = torch.Generator().manual_seed(10 + tp)
    down = torch.randn(6, 8, generator=g)
    w = _w(6, 8, R, g)
    x = torch.randn(4, 8, generator=g)
    slots = torch.tensor([1, 1, -1, 1], dtype=torch.int32)
    partial = []
    for rank in range(tp):
        layer = RowParallelLinear(8, 6, tp_size=tp, tp_rank=rank)
        layer.weight.weight_loader(layer.weight, down)
        _attach(layer, slots, [w])
        xr = x.narrow(1, rank * (8 // tp), 8 // tp)
        partial.append(layer._apply(xr, None))  # the all-reduce, by hand
    want = x @ down.T + (slots >= 0).float()[:, None] * _delta(x, w, 6)
    torch.testing.assert_close(sum(partial), want)


def test_lora_on_a_quantised_base() -> None:
    """The hook adds the delta to whatever the base method computed (here FP8)."""
    from pagedllm.layers.quantization.fp8 import Fp8Config

    g = torch.Generator().manual_seed(3)
    w_full = torch.randn(24, 32, generator=g) * 0.1
    layer = RowParallelLinear(32, 24, quant_config=Fp8Config(), prefix="x")
    layer.weight.weight_loader(layer.weight, w_full)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 32, generator=g)
    base = layer(x)
    lw = _w(24, 32, R, g)
    _attach(layer, torch.tensor([1, -1, 1], dtype=torch.int32), [lw])
    y = layer(x)
    torch.testing.assert_close(y[1], base[1])
    torch.testing.assert_close(y[[0, 2]], base[[0, 2]] + _delta(x[[0, 2]], lw, 24))


def test_slots_lru_never_evicts_an_adapter_in_use(tmp_path) -> None:
    """Three adapters through two slots: a step's adapters always stay resident, the
    least recently used other one is replaced, and the token map follows."""
    from pagedllm.lora.request import LoRARequest
    from pagedllm.worker.lora.manager import LoRAManager
    from tests.lora.fixtures import make_adapters, tiny_llama

    base = tiny_llama(str(tmp_path / "base"))
    specs = [(f"a{i}", 2, 4, False, ["q_proj"]) for i in range(3)]
    paths = [a.path for a in make_adapters(base, str(tmp_path), specs)]
    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_model

    cfg = EngineArgs(model=str(tmp_path / "base"), device="cpu").create_engine_config()
    model = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    mgr = LoRAManager(model, cfg.model_config.hf_config, 2, 4, 2, 32, torch.device("cpu"),
                      torch.float32)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]

    def step(loras, n):
        mgr.prepare_step(loras, np.asarray(n), lambda _name, a: torch.from_numpy(a))
        return mgr.mapping.token_slots[:sum(n)].tolist()

    assert step([reqs[0], None, reqs[1]], [2, 1, 1]) == [0, 0, -1, 1]
    assert step([reqs[1]], [1]) == [1]  # a1 used last: a0 is now the LRU slot
    assert step([reqs[2], reqs[1]], [1, 1]) == [0, 1]
    assert mgr.slot_ids == [3, 2]
    assert set(mgr.cpu) == {2, 3}  # max_cpu_loras 2: a0 left the host cache
    assert step([None], [1]) == [-1] and not mgr.mapping.active
    assert mgr.mapping.token_slots[:2].tolist() == [-1, -1]  # stale rows cleared
    # A step whose last layer is pruned to each request's last token: that layer's
    # modules after attention read one slot per request; the token map is unchanged.
    mgr.prepare_step([reqs[2], None, reqs[1]], np.asarray([3, 2, 1]),
                     lambda _name, a: torch.from_numpy(a), pruned=True)
    assert mgr.mapping.token_slots[:6].tolist() == [0, 0, 0, -1, -1, 1]
    assert mgr.mapping.last_slots[:3].tolist() == [0, -1, 1]
    last = cfg.model_config.hf_config.num_hidden_layers - 1
    assert {n.rsplit(".", 1)[-1] for n, lo in mgr.layers.items() if lo.last_rows} == \
        {"o_proj", "gate_up_proj", "down_proj"}
    assert all(f".layers.{last}." in n for n, lo in mgr.layers.items() if lo.last_rows)
    assert step([None], [1]) == [-1]
    assert mgr.mapping.last_slots[:3].tolist() == [-1, -1, -1]
    # The memory plan sets aside exactly what the slots take.
    from pagedllm.worker.lora.manager import lora_slot_bytes

    assert lora_slot_bytes(model, 2, 4, torch.float32) == sum(
        (lo.a.numel() + lo.bt.numel()
         + (sum(b.numel() for b in lo.bts) if len(lo.bts) > 1 else 0)) * 4
        for lo in mgr.layers.values())


def test_an_adapter_failing_to_load_fails_its_rows_only(tmp_path) -> None:
    """An adapter whose files went bad after the frontend checked them (issue 46 item 2):
    ``prepare_step`` reports it, its rows run without an adapter, the others keep their
    slots, and the slot it was to take stays free."""
    import os

    from pagedllm.lora.request import LoRARequest
    from pagedllm.worker.lora.manager import LoRAManager
    from tests.lora.fixtures import make_adapters, tiny_llama

    base = tiny_llama(str(tmp_path / "base"))
    specs = [(f"a{i}", 2, 4, False, ["q_proj"]) for i in range(2)]
    paths = [a.path for a in make_adapters(base, str(tmp_path), specs, merge=False)]
    from pagedllm.attention.torch_ref import TorchReferenceBackend
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_model

    cfg = EngineArgs(model=str(tmp_path / "base"), device="cpu").create_engine_config()
    model = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    mgr = LoRAManager(model, cfg.model_config.hf_config, 2, 4, 2, 32, torch.device("cpu"),
                      torch.float32)
    good, bad = (LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths))
    os.remove(os.path.join(paths[1], "adapter_model.safetensors"))
    failed = mgr.prepare_step([good, bad, None], np.asarray([1, 2, 1]),
                              lambda _name, a: torch.from_numpy(a))
    assert list(failed) == [2] and "a1" in failed[2]
    assert mgr.mapping.token_slots[:4].tolist() == [0, -1, -1, -1]
    assert mgr.slot_ids == [1, None] and set(mgr.cpu) == {1}
