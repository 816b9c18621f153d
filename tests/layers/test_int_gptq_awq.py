"""GPTQ and AWQ checkpoints (``gptq.py``, ``awq.py``).

No GPTQ or AWQ library installs here (GPTQModel and AutoAWQ are CUDA-built sdists), so
the fixtures are packed by reference packers written from the formats' published bit
layouts (``tests/layers/int_fixtures.py``: AutoGPTQ's ``pack`` loop, AutoAWQ's
``AWQ_ORDER`` GEMM packing).  Checked here:

* the round trip: reference packer -> checkpoint -> our loader and unpacker -> the
  canonical layout, whose dequantisation equals the reference dequantisation exactly;
* greedy output equals transformers running the dequantised float model (transformers
  cannot load GPTQ/AWQ checkpoints without those libraries), with the same threshold as
  the compressed-tensors tests (bf16 int4 kernels on the CPU: divergences only at
  near-ties; fp32 paths: every prompt);
* batched equals alone (int4 kernels: alone diverges from transformers only at near-ties
  too; a batch of >= 16 rows runs the bf16-scratch GEMM of ``int4_dequant.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.layers.quantization.awq import AWQ_ORDER
from tests.layers.fp8_fixtures import tiny_llama
from tests.layers.int_fixtures import AWQ_ORDER as REF_AWQ_ORDER
from tests.layers.int_fixtures import float_twin, save_int_checkpoint
from tests.layers.int_harness import (
    PROMPTS,
    fused_reference,
    greedy,
    hf_greedy,
    load,
    loaded_int_weights,
    matching,
    near_tie_divergences,
)

TIE = 0.1  # see test_int_compressed_tensors.py

# name -> (format, save kwargs, CPU kernel)
CASES = {
    "gptq_4bit_g32_sym": ("gptq", dict(bits=4, group=32), "int4pack"),
    "gptq_4bit_g32_actorder_asym": ("gptq", dict(bits=4, group=32, desc_act=True,
                                                 sym=False), "int4pack"),
    "gptq_8bit_channel": ("gptq", dict(bits=8, group=-1), "int8pack"),
    "gptq_8bit_g16_actorder": ("gptq", dict(bits=8, group=16, desc_act=True), "dense"),
    "awq_4bit_g32": ("awq", dict(group=32), "int4pack"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    name = request.param
    fmt, kw, kernel = CASES[name]
    path = str(tmp_path_factory.mktemp(name))
    hf = tiny_llama(seed=8)
    if kw.get("group") == -1:
        deq = _save_channel(hf, path, kw)
    else:
        deq = save_int_checkpoint(hf, path, fmt, **kw)
    return name, path, deq, kernel


def _save_channel(hf, path: str, kw: dict) -> dict:  # type: ignore[no-untyped-def]
    """A channel-wise GPTQ checkpoint (``group_size: -1``): each layer packed with its
    own K as the group."""
    from safetensors.torch import save_file

    from tests.layers.int_fixtures import pack_gptq

    state, deq = {}, {}
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if name.endswith("proj.weight"):
            tensors, d = pack_gptq(t, kw["bits"], t.shape[1], False, True, seed=i)
            mod = name[:-len(".weight")]
            state.update({f"{mod}.{k}": v for k, v in tensors.items()})
            deq[mod] = d
        else:
            state[name] = t.contiguous()
    hf.config.save_pretrained(path)
    save_file(state, f"{path}/model.safetensors")
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": kw["bits"],
                                  "group_size": -1, "desc_act": False, "sym": True}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return deq


def test_awq_order_is_autoawqs() -> None:
    assert AWQ_ORDER == REF_AWQ_ORDER == [0, 2, 4, 6, 1, 3, 5, 7]


def test_round_trip_equals_reference_dequantisation(checkpoint) -> None:  # type: ignore
    name, path, deq, _ = checkpoint
    ours = loaded_int_weights(path)
    assert len(ours) == 8
    for prefix, iw in ours.items():
        ref = fused_reference(deq, prefix)
        # fp16 scales, integer codes: exact in float32 on both sides
        assert torch.equal(iw.dequantize(torch.float32), ref), (name, prefix)
        assert (iw.g_idx is not None) == ("actorder" in name)


def test_greedy_matches_transformers_on_the_dequantised_model(checkpoint) -> None:  # type: ignore
    name, path, deq, kernel = checkpoint
    model, cfg = load(path)
    assert model.model.layers[0].mlp.gate_up_proj.int_kind == kernel, name
    assert cfg.model_config.quantization == CASES[name][0]
    assert CASES[name][0] in model.quant_description
    hf = float_twin(tiny_llama(seed=8), deq, seed=8)
    ref = hf_greedy(hf, PROMPTS)
    ours = greedy(model, cfg, PROMPTS)
    if kernel == "int4pack":
        exact, real = near_tie_divergences(ours, ref, hf, PROMPTS, TIE)
        assert not real and exact >= len(PROMPTS) // 2, (name, exact, real)
    else:
        assert matching(ours, ref) == len(PROMPTS), (name, ours, ref)
    alone = greedy(model, cfg, PROMPTS[:3], batched=False)
    if kernel == "int4pack":  # alone: the int4 kernel; batched: the bf16 scratch GEMM
        assert not near_tie_divergences(alone, ref[:3], hf, PROMPTS[:3], TIE)[1], name
    else:
        assert alone == ours[:3]


def test_unsupported_configs_name_them(tmp_path) -> None:
    tiny_llama().save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        base = json.load(f)
    for qc, msg in [
        ({"quant_method": "gptq", "bits": 3, "group_size": 32},
         r"GPTQ quantization_config.bits: 3-bit weights are not supported; supported: 4, 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
         r"AWQ checkpoint \(version 'gemv', 4 bits, zero_point True\) is not supported; "
         r"supported: AWQ GEMM"),
        ({"quant_method": "bitnet"},
         r"quant_method 'bitnet' is not supported; supported: awq, compressed-tensors"),
    ]:
        with open(tmp_path / "config.json", "w") as f:
            json.dump({**base, "quantization_config": qc}, f)
        with pytest.raises(ValueError, match=msg):
            load(str(tmp_path))


def test_corrupt_qzeros_names_the_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_int_checkpoint(tiny_llama(seed=9), str(tmp_path), "gptq", bits=4, group=32)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    name = "model.layers.0.mlp.up_proj.qzeros"
    state[name] = state[name][:1].contiguous()
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}': shape mismatch"):
        load(str(tmp_path))


@pytest.mark.parametrize("bits,group,desc_act,sym,kind", [
    (4, 32, False, True, "int4pack"), (4, 64, True, False, "int4pack"),
    (4, -1, False, False, "int4pack"), (8, -1, False, False, "int8pack"),
    (8, 32, True, False, "int4pack"), (8, 16, False, True, "dense"),
])
def test_cpu_kernels_match_the_reference(bits: int, group: int, desc_act: bool, sym: bool,
                                         kind: str) -> None:
    """Each CPU path of ``int_linear`` against ``x @ w_ref^T`` of the reference packer's
    dequantisation: bf16 int4 kernels within bf16 rounding, the rest in fp32."""
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.gptq import GPTQConfig
    from tests.layers.int_fixtures import pack_gptq

    n, k = 96, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(bits + group)) * 0.05
    tensors, deq = pack_gptq(w, bits, k if group == -1 else group, desc_act, sym, seed=1)
    qc = GPTQConfig(bits, None if group == -1 else group, desc_act, sym, True, [])
    layer = ReplicatedLinear(k, n, bias=True, quant_config=qc, prefix="x")
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    layer.bias.data.copy_(torch.randn(n) * 0.1)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int_kind == kind
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    ref = x @ deq.T + layer.bias
    err = float((layer(x) - ref).norm() / ref.norm())
    assert err < (1e-2 if kind == "int4pack" else 1e-5), err


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_tensor_parallel_shards(fmt: str) -> None:
    """Each rank of a tp=2 merged-column (gate/up) and row-parallel layer holds its slice
    of the canonical weight: packing and grouped scales shard through the layer's
    generic loader."""
    from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from pagedllm.layers.quantization.awq import AWQConfig
    from pagedllm.layers.quantization.gptq import GPTQConfig
    from tests.layers.int_fixtures import pack_awq, pack_gptq

    g = torch.Generator().manual_seed(4)
    gate, up, down = (torch.randn(s, generator=g) * 0.05 for s in ((64, 128), (64, 128),
                                                                    (128, 128)))
    packed = [pack_gptq(w, 4, 32, False, False, seed=1) if fmt == "gptq" else pack_awq(w, 32)
              for w in (gate, up, down)]
    qc = GPTQConfig(4, 32, False, False, True, []) if fmt == "gptq" else AWQConfig(32, [])
    for rank in range(2):
        gu = MergedColumnParallelLinear(128, [64, 64], tp_size=2, tp_rank=rank,
                                        quant_config=qc, prefix="gate_up_proj")
        dn = RowParallelLinear(128, 128, tp_size=2, tp_rank=rank, quant_config=qc,
                               prefix="down_proj")
        for shard, (tensors, _) in enumerate(packed[:2]):
            for name, t in tensors.items():
                getattr(gu, name).weight_loader(getattr(gu, name), t, shard)
        for name, t in packed[2][0].items():
            getattr(dn, name).weight_loader(getattr(dn, name), t)
        rows = slice(32 * rank, 32 * rank + 32)
        want = torch.cat([packed[0][1][rows], packed[1][1][rows]])
        assert torch.equal(gu.quant_method.to_int_weight(gu).dequantize(torch.float32), want)
        cols = slice(64 * rank, 64 * rank + 64)
        assert torch.equal(dn.quant_method.to_int_weight(dn).dequantize(torch.float32),
                           packed[2][1][:, cols])


def test_gptq_modules_in_block_to_quantize() -> None:
    """Only the listed block modules are quantised; the rest keep float weights."""
    from pagedllm.layers.quantization.gptq import GPTQConfig

    hf = type("Cfg", (), {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32,
        "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj"], ["mlp.down_proj"]]}})()
    qc = GPTQConfig.from_config(hf, None)
    picked = {p: qc.get_linear_method(None, f"model.layers.0.{p}") is not None
              for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                        "mlp.down_proj")}
    assert picked == {"self_attn.qkv_proj": True, "self_attn.o_proj": False,
                      "mlp.gate_up_proj": False, "mlp.down_proj": True}
