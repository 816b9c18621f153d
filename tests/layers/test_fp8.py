"""FP8 W8A8 linear layers (layers/quantization/fp8.py) and the FP8 checkpoints that load
into them (HF fine-grained FP8, compressed-tensors float-quantized), on the CPU
reference path (fp8 stored, computed by upcasting)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.quant_common import FP8_DTYPE, FP8_MAX, quantize_fp8_rows
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.layers.quantization.fp8 import Fp8Config, check_fp8_capability
from pagedllm.models.loader import load_model
from tests.layers.fp8_fixtures import save_compressed_tensors, save_hf_fp8, tiny_llama
from tests.models.paged import PagedSession


def _fp8_layer(cls, *args, per_tensor: bool = False, **kw):
    return cls(*args, quant_config=Fp8Config(weight_per_tensor=per_tensor), prefix="x", **kw)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 32), (7, 96, 160), (33, 256, 48)])
def test_fp8_linear_matches_float(shape: tuple[int, int, int], per_tensor: bool) -> None:
    t, k, n = shape
    g = torch.Generator().manual_seed(t + k + n)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1  # row ranges
    x = torch.randn(t, k, generator=g)
    bias = torch.randn(n, generator=g)
    layer = _fp8_layer(RowParallelLinear, k, n, bias=True, per_tensor=per_tensor)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (n,)
    if per_tensor:
        assert torch.all(layer.weight_scale == layer.weight_scale[0])
    y = layer(x)
    ref = x @ w.T + bias
    # e4m3 has 3 mantissa bits: ~2^-4 relative rounding per operand, averaged over k.
    assert _rel_err(y, ref) < 0.05
    # Exactly the quantised operands, upcast: per-token x scales, per-channel w scales.
    xq, xs = quantize_fp8_rows(x)
    exact = (xq.double() @ layer.weight.double().T) * xs.double() \
        * layer.weight_scale.double() + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


def test_fp8_zero_and_saturation() -> None:
    layer = _fp8_layer(RowParallelLinear, 32, 16, bias=False)
    w = torch.randn(16, 32)
    w[3] = 0.0  # an all-zero output channel
    w[5, 7] = 1e6  # a channel dominated by one huge weight
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    wq = layer.weight.float()
    assert torch.isfinite(wq).all() and wq.abs().max() <= FP8_MAX
    assert torch.all(wq[3] == 0) and wq[5, 7] == FP8_MAX
    x = torch.randn(4, 32)
    x[1] = 0.0  # a zero token
    x[2, 0] = 1e30  # a token that saturates without overflowing
    y = layer(x)
    assert torch.isfinite(y).all()
    assert torch.all(y[1] == 0) and torch.all(y[:, 3] == 0)
    torch.testing.assert_close(y[0], (x[0] @ w.T), rtol=0.1, atol=0.05 * float(
        (x[0] @ w.T).abs().max()))


def test_fp8_fused_shards() -> None:
    """q/k/v and gate/up shards quantise per output channel of the fused weight."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 32, generator=g) * s for n, s in ((32, 1.0), (16, 10.0),
                                                               (16, 0.01)))
    layer = _fp8_layer(QKVParallelLinear, 32, 8, 4, 2)
    for sid, t in zip("qkv", (q, k, v)):
        layer.weight.weight_loader(layer.weight, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 32, generator=g)
    y = layer(x)
    for part, ref in zip(y.split([32, 16, 16], 1), (x @ q.T, x @ k.T, x @ v.T)):
        assert _rel_err(part, ref) < 0.05
    gu = _fp8_layer(MergedColumnParallelLinear, 32, [24, 24])
    gate, up = torch.randn(24, 32, generator=g), torch.randn(24, 32, generator=g) * 5
    gu.weight.weight_loader(gu.weight, gate, 0)
    gu.weight.weight_loader(gu.weight, up, 1)
    gu.quant_method.process_weights_after_loading(gu)
    assert _rel_err(gu(x), torch.cat([x @ gate.T, x @ up.T], 1)) < 0.05


def test_capability_check_names_quantization() -> None:
    check_fp8_capability((9, 0))
    check_fp8_capability((8, 9))
    with pytest.raises(ValueError, match=r"quantization='fp8'.*8\.9.*8\.0.*choose another"):
        check_fp8_capability((8, 0), "NVIDIA A100")


def test_unknown_quantization_name(tmp_path) -> None:
    tiny_llama().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"quantization must be one of .*fp8.*'fp9'"):
        EngineArgs(model=str(tmp_path), quantization="fp9").create_engine_config()


def _logits(path: str, prompts: list[list[int]], **kw) -> list[torch.Tensor]:
    cfg = EngineArgs(model=path, device="cpu", dtype="float32", **kw).create_engine_config()
    model = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    mc = cfg.model_config
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=32)
    out = s.step({i: p for i, p in enumerate(prompts)})
    return [out[i] for i in range(len(prompts))], model, cfg


PROMPTS = [[1, 5, 9, 33, 2, 8, 100, 7, 64], [3, 4, 150, 11]]


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_compressed_tensors_checkpoint(tmp_path, preset: str) -> None:
    hf = tiny_llama(seed=1)
    ref_unq = [_hf_logits(hf, p) for p in PROMPTS]
    oracle = save_compressed_tensors(hf, str(tmp_path), preset)
    ref_q = [_hf_logits(oracle, p) for p in PROMPTS]
    ours, model, cfg = _logits(str(tmp_path), PROMPTS)
    assert cfg.model_config.quantization == "compressed-tensors"
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == torch.float32
    for o, rq, ru in zip(ours, ref_q, ref_unq):
        # The library's fake-quantised forward is the oracle: same e4m3 weights and
        # scales, activations quantised per token (FP8_DYNAMIC) or with the static
        # input_scale (FP8) by both.
        assert float((o - rq).abs().max()) < 2e-3 * float(rq.abs().max()) + 1e-4
        assert _rel_err(o, ru) < 0.15  # near the float model (random: ~8%)


def test_hf_fp8_block_checkpoint(tmp_path) -> None:
    hf = tiny_llama(seed=2)
    deq = save_hf_fp8(hf, str(tmp_path), (32, 32))
    ref = tiny_llama(seed=2)
    ref.load_state_dict(deq)
    ours, model, cfg = _logits(str(tmp_path), PROMPTS)
    assert cfg.model_config.quantization == "fp8"
    assert model.model.layers[1].mlp.down_proj.weight.dtype == FP8_DTYPE
    for o, p in zip(ours, PROMPTS):
        r = _hf_logits(ref, p)
        # Block scales are folded into per-channel ones: a second e4m3 rounding of the
        # weights (~3% each, doubling the online-quantisation error) + per-token
        # activations, amplified by this random model's two layers.
        assert _rel_err(o, r) < 0.2


def test_online_fp8_and_dummy(tmp_path) -> None:
    hf = tiny_llama(seed=3)
    hf.save_pretrained(str(tmp_path))
    ref = [_hf_logits(hf, p) for p in PROMPTS]
    ours, model, cfg = _logits(str(tmp_path), PROMPTS, quantization="fp8")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # The loader links each norm to the FP8 projection reading it (on CUDA the norm
    # quantises that projection's input: test_fused_quantisers_change_nothing).
    layer = model.model.layers[0]
    assert layer.input_layernorm.linear_next is layer.self_attn.qkv_proj
    assert layer.post_attention_layernorm.linear_next is layer.mlp.gate_up_proj
    for o, r in zip(ours, ref):
        assert _rel_err(o, r) < 0.15
    dummy, model, _ = _logits(str(tmp_path), PROMPTS, quantization="fp8",
                              load_format="dummy")
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == FP8_DTYPE
    assert all(torch.isfinite(d).all() for d in dummy)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an FP8 GPU")
def test_fused_quantisers_change_nothing(tmp_path) -> None:
    """On CUDA the RMSNorms quantise qkv_proj's and gate_up_proj's inputs: the logits
    (prefill of two requests, then a batch-1 decode step) equal bit for bit those of the
    norms and quantisers run apart."""
    tiny_llama(seed=4).save_pretrained(str(tmp_path))
    cfg = EngineArgs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                     quantization="fp8").create_engine_config()
    model = load_model(cfg.model_config, torch.device("cuda"), TorchReferenceBackend())
    mc = cfg.model_config

    def run() -> list[torch.Tensor]:
        s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                         num_blocks=32, dtype=torch.bfloat16, device="cuda")
        first = s.step({i: p for i, p in enumerate(PROMPTS)})
        return [*first.values(), s.step({0: [17]})[0]]

    fused = run()
    norms = [m for m in model.modules() if getattr(m, "linear_next", None) is not None]
    assert len(norms) == 2 * mc.num_layers
    for n in norms:
        n.linear_next = None
    for a, b in zip(fused, run()):
        assert torch.equal(a, b)


def test_kv_cache_dtype_validation_and_planner(tmp_path) -> None:
    from pagedllm.worker.worker import Worker

    tiny_llama().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, "
                                         r"fp8_e4m3, got 'int8'"):
        EngineArgs(model=str(tmp_path), kv_cache_dtype="int8").create_engine_config()
    blocks = {}
    for kv in ("auto", "fp8", "fp8_e4m3"):
        cfg = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16",
                         kv_cache_dtype=kv, kv_cache_memory_bytes=8 << 20,
                         max_model_len=256).create_engine_config()
        blocks[kv] = Worker(cfg).determine_num_blocks()
    assert blocks["fp8"] == blocks["fp8_e4m3"] == 2 * blocks["auto"]  # 1 byte vs 2


def test_compressed_tensors_int_scheme_dispatch() -> None:
    """Int schemes go to compressed_tensors_int.make_int_method; without that module the
    error names the scheme and what is supported."""
    import importlib.util

    from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig

    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                "strategy": "group", "group_size": 128}}
    hf = type("Cfg", (), {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"]}})()
    if importlib.util.find_spec("pagedllm.layers.quantization.compressed_tensors_int"):
        CompressedTensorsConfig.from_config(hf, None)  # the int helper's method
        return
    with pytest.raises(ValueError, match=r"scheme weights int4/group is not supported; "
                                         r"supported: float 8-bit"):
        CompressedTensorsConfig.from_config(hf, None)
