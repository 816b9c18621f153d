"""compressed-tensors integer checkpoints (``compressed_tensors_int.py``): fixtures made
by the compressed-tensors library from a tiny random Llama, loaded by pagedllm.

* dequantised weights (the canonical layout straight after loading) equal the
  library's own decompression exactly;
* greedy output equals transformers loading the same checkpoint.  transformers 5 loads
  the symmetric schemes and W8A8 (it decompresses them and runs the library's
  activation quantisation); it refuses the asymmetric ``pack-quantized`` ones (its
  parameter for the packed ``weight_zero_point`` has the unpacked shape), so for those
  the reference is transformers on the library-decompressed float model;
* batched equals alone; for the bf16 int4 kernels, alone diverges from transformers
  only at near-ties too (a batch of >= 16 rows runs the bf16-scratch GEMM of
  ``int4_dequant.py``, one alone the int4 kernel: the same weights, rounded differently).

Threshold: layers on torch's int4 kernels compute in bf16 on the CPU (the fast path;
logits within ~1% of transformers' fp32 here), so a continuation may leave
transformers' at a near-tie: every prompt must match over 8 tokens or diverge first
where transformers' own two logits are within ``TIE`` (0.1; logits span ~+-2), and at
least half the prompts must match exactly.  Paths computing in fp32 (int8pack, dense,
W8A8) must match on every prompt.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedllm.layers.quantization.int_layout import pack_codes, unpack_codes
from tests.layers.fp8_fixtures import tiny_llama
from tests.layers.int_fixtures import (
    ct_decompressed_state,
    ct_scheme,
    float_twin,
    save_ct_int,
)
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
from tests.models.paged import PagedSession

TIE = 0.1  # module doc
BF16_KERNELS = ("int4pack",)

# name -> (scheme kwargs, format, what pagedllm's CPU path runs)
SCHEMES = {
    "w4a16_group32_sym": (dict(bits=4, strategy="group", group_size=32), "pack-quantized",
                          "int4pack"),
    "w4a16_group32_asym": (dict(bits=4, strategy="group", group_size=32, symmetric=False),
                           "pack-quantized", "int4pack"),
    "w4a16_channel_asym": (dict(bits=4, strategy="channel", symmetric=False),
                           "pack-quantized", "int4pack"),
    "w8a16_channel_sym": (dict(bits=8, strategy="channel"), "pack-quantized", "int8pack"),
    "w8a16_channel_asym": (dict(bits=8, strategy="channel", symmetric=False),
                           "pack-quantized", "int8pack"),
    "w8a16_group32_sym": (dict(bits=8, strategy="group", group_size=32), "pack-quantized",
                          "int4pack"),
    "w4a16_group16_sym": (dict(bits=4, strategy="group", group_size=16), "pack-quantized",
                          "dense"),
}


def test_canonical_packing_is_the_library_packing() -> None:
    """compressed-tensors' ``pack_to_int32`` of signed codes is our canonical packing of
    the unsigned ones (codes + 2**(bits-1)), and unpacks back."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        half = 1 << (bits - 1)
        q = torch.randint(-half, half, (24, 64), generator=g, dtype=torch.int32)
        lib = pack_to_int32(q.to(torch.int8), bits)
        assert torch.equal(pack_codes(q + half, bits), lib)
        assert torch.equal(unpack_codes(lib, bits), q + half)


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def checkpoint(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    name = request.param
    kw, fmt, kernel = SCHEMES[name]
    path = str(tmp_path_factory.mktemp(name))
    scheme = ct_scheme(**kw)
    hf = tiny_llama(seed=5)
    _, compressed = save_ct_int(hf, path, scheme, fmt)
    return name, path, ct_decompressed_state(compressed, fmt), kernel, kw


def test_dequantised_weights_equal_the_library(checkpoint) -> None:  # type: ignore[no-untyped-def]
    _, path, decompressed, _, _ = checkpoint
    ours = loaded_int_weights(path)
    assert len(ours) == 2 * 4  # qkv, o, gate_up, down per layer
    for prefix, iw in ours.items():
        ref = fused_reference(decompressed, prefix)
        assert torch.equal(iw.dequantize(torch.float32), ref), prefix


def test_greedy_matches_transformers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    name, path, decompressed, kernel, kw = checkpoint
    model, cfg = load(path)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.int_kind == kernel
    assert cfg.model_config.quantization == "compressed-tensors"
    gs = f"group {kw['group_size']}" if kw.get("group_size") else "channel"
    assert f"int{kw['bits']} {gs}" in model.quant_description
    if kw.get("symmetric", True):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        hf = float_twin(tiny_llama(seed=5), decompressed, seed=5)
    ref = hf_greedy(hf.eval(), PROMPTS)
    batched = greedy(model, cfg, PROMPTS)
    if kernel in BF16_KERNELS:
        exact, real = near_tie_divergences(batched, ref, hf, PROMPTS, TIE)
        assert not real and exact >= len(PROMPTS) // 2, (name, exact, real)
    else:
        assert matching(batched, ref) == len(PROMPTS), (name, batched, ref)
    alone = greedy(model, cfg, PROMPTS[:3], batched=False)
    if kernel in BF16_KERNELS:
        assert not near_tie_divergences(alone, ref[:3], hf, PROMPTS[:3], TIE)[1], name
    else:
        assert alone == batched[:3]


def test_w8a8_int8(tmp_path) -> None:
    """W8A8-INT8 (``int-quantized``): int8 weights as the library wrote them; greedy
    equals transformers, which runs the library's dynamic per-token activation
    quantisation too."""
    hf = tiny_llama(seed=6)
    oracle, compressed = save_ct_int(hf, str(tmp_path), ct_scheme(8, "channel", w8a8=True),
                                     "int-quantized")
    model, cfg = load(str(tmp_path))
    down = model.model.layers[1].mlp.down_proj
    assert down.weight_t.dtype == torch.int8 and "W8A8" in model.quant_description
    ref_w = ct_decompressed_state(compressed, "int-quantized")["model.layers.1.mlp.down_proj"]
    assert torch.equal(down.weight_t.t().float() * down.weight_scale.view(-1, 1), ref_w)
    hf_loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                  dtype=torch.float32)
    ref = hf_greedy(hf_loaded.eval(), PROMPTS)
    ours = greedy(model, cfg, PROMPTS)
    assert matching(ours, ref) == len(PROMPTS), (ours, ref)
    assert greedy(model, cfg, PROMPTS, batched=False) == ours


def test_unsupported_scheme_names_it(tmp_path) -> None:
    tiny_llama().save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 3, "type": "int", "strategy": "group", "group_size": 32,
            "symmetric": True}}}}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"scheme int3 weights/group 32 symmetric "
                                         r"\(pack-quantized\) is not supported \(3-bit "
                                         r"weights\); supported: int weight-only"):
        load(str(tmp_path))


def test_truncated_tensor_names_it(tmp_path) -> None:
    """A packed weight cut short is a load error naming the checkpoint tensor."""
    from safetensors.torch import load_file, save_file

    save_ct_int(tiny_llama(seed=7), str(tmp_path), ct_scheme(4, "group", 32),
                "pack-quantized")
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    name = "model.layers.1.self_attn.k_proj.weight_packed"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}': shape mismatch"):
        load(str(tmp_path))


def test_dummy_weights_in_the_w4a16_layout(tmp_path) -> None:
    """``load_format="dummy"`` fills the checkpoint's int layout (random codes, small
    scales) and repacks it: what the GPU benchmarks of W4A16 load."""
    tiny_llama().config.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
            "symmetric": False}}}}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    model, cfg = load(str(tmp_path), load_format="dummy")
    assert model.model.layers[0].self_attn.qkv_proj.int_kind == "int4pack"
    mc = cfg.model_config
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=8)
    logits = s.step({0: PROMPTS[0]})[0]
    assert logits.shape == (len(PROMPTS[0]), 160) and bool(torch.isfinite(logits).all())
