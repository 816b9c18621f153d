"""FP8 MoE models end to end on the CPU (fp32 activations): tiny random Qwen3-MoE and
Mixtral (``tests/models/tiny_models.py``) with ``quantization="fp8"`` (experts e4m3
weight-only, attention W8A8) against the same model unquantised; compressed-tensors FP8
checkpoints of them (the library's own quantiser and compressor,
``tests/layers/fp8_moe_fixtures.py``) against transformers on the dequantised experts;
block-wise FP8 MoE checkpoints (transformers' fine-grained FP8, compressed-tensors
FP8_BLOCK) folded at load; dummy FP8 MoE weights.

Thresholds (random tiny models are chaotic: a logit gap of a few hundredths decides a
token, and a changed token changes every later one, so whole greedy continuations are
not the measure):

* teacher forced over 4 prompts (220 positions): top-1 tokens agree at >= 80% of
  positions; the mean |delta log-prob| of the float model's top token stays < 0.08 nats
  and the perplexity of the prompt's own next tokens within 3%;
* greedy through the engine (8 prompts, 12 tokens): the first generated token equals
  the unquantised model's for >= 6 of 8 prompts.

The figures are printed (``pytest -s``); measured at this commit: see the report of the
branch ``moefp8``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.quant_common import FP8_DTYPE
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.models.loader import load_model, weight_bytes
from tests.layers.fp8_moe_fixtures import save_compressed_tensors_moe
from tests.models.paged import PagedSession, hf_logits_of
from tests.models.tiny_models import HF_CLASSES, VOCAB, build

ARCHS = ["qwen3_moe", "mixtral"]


def _load(path: str, **kw):  # type: ignore[no-untyped-def]
    cfg = EngineArgs(model=path, device="cpu", dtype="float32", **kw).create_engine_config()
    return load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend()), cfg


def _logits(model, cfg, prompts: list[list[int]]) -> list[torch.Tensor]:  # type: ignore
    mc = cfg.model_config
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48)
    out = s.step(dict(enumerate(prompts)))
    return [out[i] for i in range(len(prompts))]


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_online_fp8_close_to_unquantised(arch: str, tmp_path) -> None:
    build(arch, str(tmp_path))
    base, cfg = _load(str(tmp_path))
    fp8, cfg8 = _load(str(tmp_path), quantization="fp8")
    moes = [m for m in fp8.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.quant_method, Fp8MoEMethod) for m in moes)
    assert all(m.w13_weight.dtype == FP8_DTYPE and m.w2_weight.dtype == FP8_DTYPE
               for m in moes)
    # The start-up log's weight bytes: e4m3 experts (1 byte, plus fp32 scales).
    expert_params = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in moes)
    assert weight_bytes(base) - weight_bytes(fp8) >= 3 * expert_params - 4 * sum(
        m.w13_weight_scale.numel() + m.w2_weight_scale.numel() for m in moes)

    prompts = _prompts((70, 45, 60, 45), seed=3)
    agree = n = 0
    dlp = 0.0
    nll = {"float": 0.0, "fp8": 0.0}
    for p, lf, lq in zip(prompts, _logits(base, cfg, prompts), _logits(fp8, cfg8, prompts)):
        lpf, lpq = lf.log_softmax(-1), lq.log_softmax(-1)
        top = lpf.argmax(-1)
        agree += int((lpq.argmax(-1) == top).sum())
        n += len(p)
        dlp += float((lpf.gather(1, top[:, None]) - lpq.gather(1, top[:, None])).abs().sum())
        nxt = torch.tensor(p[1:])[:, None]
        nll["float"] -= float(lpf[:-1].gather(1, nxt).sum())
        nll["fp8"] -= float(lpq[:-1].gather(1, nxt).sum())
    positions = sum(len(p) - 1 for p in prompts)
    ppl = {k: math.exp(v / positions) for k, v in nll.items()}
    print(f"\n{arch} fp8 vs float: top-1 agreement {agree / n:.3f} over {n} positions, "
          f"mean |dlogprob| {dlp / n:.4f} nats, perplexity {ppl['float']:.2f} -> "
          f"{ppl['fp8']:.2f}")
    assert agree / n >= 0.80
    assert dlp / n < 0.08
    assert abs(ppl["fp8"] / ppl["float"] - 1.0) < 0.03


@pytest.mark.parametrize("arch", ARCHS)
def test_online_fp8_greedy_engine(arch: str, tmp_path) -> None:
    build(arch, str(tmp_path))
    prompts = _prompts((5, 9, 17, 24, 31, 40, 12, 50), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for quant in (None, "fp8"):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                  quantization=quant, max_model_len=128)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        tokens[quant] = [list(o.outputs[0].token_ids) for o in outs]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), len(f))
                   for f, q in zip(tokens[None], tokens["fp8"])]
    print(f"\n{arch} greedy fp8 vs float: tokens equal before the first difference, per "
          f"prompt: {same_prefix} (of 12)")
    assert sum(s > 0 for s in same_prefix) >= 6


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8", "FP8_BLOCK"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compressed_tensors_fp8_moe_checkpoint(arch: str, preset: str, tmp_path) -> None:
    """Per-channel (FP8_DYNAMIC) and per-tensor + static input scales (FP8) expert
    checkpoints load as e4m3 and equal transformers on the dequantised experts (the
    experts run weight-only; the static input scales are loaded and unused); so do the
    same tensors under an HF ``quant_method: fp8`` config.  Block scales (FP8_BLOCK,
    16 x 16 blocks) are folded into per-channel ones at load: one more e4m3 rounding,
    so near (not equal to) transformers on the dequantised blocks."""
    pytest.importorskip("compressed_tensors")
    ckpt, ref_dir = tmp_path / "ckpt", tmp_path / "ref"
    hf = build(arch, str(ckpt))
    deq = save_compressed_tensors_moe(str(ckpt), preset)
    ref = HF_CLASSES[arch](hf.config).eval()
    ref.save_pretrained(str(ref_dir))  # the float layout, then the dequantised values
    from safetensors.torch import save_file

    save_file(deq, str(ref_dir / "model.safetensors"))
    ref = HF_CLASSES[arch].from_pretrained(str(ref_dir)).eval()
    ours, cfg = _load(str(ckpt))
    assert cfg.model_config.quantization == "compressed-tensors"
    moe = next(m for m in ours.modules() if isinstance(m, FusedMoE))
    assert moe.w13_weight.dtype == FP8_DTYPE
    assert moe.w13_weight_scale.shape == moe.w13_weight.shape[:2]
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    prompts = _prompts((33, 20), seed=5)
    for p, got in zip(prompts, _logits(ours, cfg, prompts)):
        if preset == "FP8_BLOCK":
            err = _rel_err(got, hf_logits_of(ref, p))
            print(f"\n{arch} FP8_BLOCK folded: logits rel. error {err:.4f}")
            assert err < 0.06
        else:
            torch.testing.assert_close(got, hf_logits_of(ref, p), atol=1e-4, rtol=0)
    if preset == "FP8_BLOCK":
        return
    # The same tensors as a Hugging Face FP8 checkpoint (quant_method "fp8", attention
    # listed as ignored): Fp8Config's MoE hook, per-channel or per-tensor + static.
    cfg_file = ckpt / "config.json"
    hf_cfg = json.loads(cfg_file.read_text())
    hf_cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "ignored_layers": ["re:.*self_attn.*"],
        "activation_scheme": "static" if preset == "FP8" else "dynamic"}
    cfg_file.write_text(json.dumps(hf_cfg))
    ours_hf, cfg_hf = _load(str(ckpt))
    assert cfg_hf.model_config.quantization == "fp8"
    for p, got in zip(prompts, _logits(ours_hf, cfg_hf, prompts)):
        torch.testing.assert_close(got, hf_logits_of(ref, p), atol=1e-4, rtol=0)
    if preset == "FP8_DYNAMIC" and os.environ.get("TRITON_INTERPRET") == "1":
        # The W_FP8 sorted Triton kernels (interpreted) in every MoE layer, prefill
        # then decodes (one token: the sorted path too).
        for m in ours.modules():
            if isinstance(m, FusedMoE):
                m.use_triton = True
        ids = prompts[0]
        mc = cfg.model_config
        s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16)
        got = torch.cat([s.step({0: ids[:28]})[0]] + [s.step({0: [t]})[0] for t in ids[28:]])
        torch.testing.assert_close(got, hf_logits_of(ref, ids), atol=1e-4, rtol=0)
    if torch.cuda.is_available():
        _cuda_bf16_check(cfg, ref, prompts[0])


def _cuda_bf16_check(cfg, ref: torch.nn.Module, ids: list[int]) -> None:  # type: ignore
    """On a GPU: bf16, Triton attention and the W_FP8 kernels; logits loosely equal
    transformers' fp32 ones on the dequantised experts."""
    import dataclasses

    from pagedllm.attention.triton_backend import TritonAttentionBackend

    mc = dataclasses.replace(cfg.model_config, dtype="bfloat16")
    ours = load_model(mc, torch.device("cuda"), TritonAttentionBackend())
    s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16,
                     dtype=torch.bfloat16, device="cuda")
    got = torch.cat([s.step({0: ids[:25]})[0]] + [s.step({0: [t]})[0] for t in ids[25:]])
    torch.testing.assert_close(got.float().cpu(), hf_logits_of(ref, ids), atol=0.15, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_online_fp8_moe(arch: str, tmp_path) -> None:
    """On a GPU: ``quantization="fp8"`` in bf16 (W8A8 linears, W_FP8 experts) agrees
    with transformers' fp32 top-1 tokens teacher forced (>= 70%: bf16 rounding on top
    of the CPU's fp32 ~88%)."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    hf = build(arch, str(tmp_path))
    cfg = EngineArgs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                     quantization="fp8").create_engine_config()
    mc = cfg.model_config
    ours = load_model(mc, torch.device("cuda"), TritonAttentionBackend())
    ids = _prompts((60,), seed=3)[0]
    s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16,
                     dtype=torch.bfloat16, device="cuda")
    got = torch.cat([s.step({0: ids[:40]})[0]] + [s.step({0: [t]})[0] for t in ids[40:]])
    ref = hf_logits_of(hf, ids)
    agree = float((got.float().cpu().argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\n{arch} cuda bf16 fp8 top-1 agreement with fp32 float: {agree:.3f}")
    assert agree >= 0.7


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_fine_grained_fp8_moe_checkpoint(arch: str, tmp_path) -> None:
    """transformers' fine-grained FP8 (``weight_block_size``, ``weight_scale_inv``; the
    layout of Qwen's official -FP8 releases), the experts quantised by transformers' own
    ``Fp8Quantize``: the block scales fold into per-channel ones at load; near
    transformers on the dequantised blocks.  Under tensor parallelism a rank's slice
    that is not whole blocks is a ValueError naming ``weight_block_size``."""
    from types import SimpleNamespace

    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    ckpt, ref_dir = tmp_path / "ckpt", tmp_path / "ref"
    hf = build(arch, str(ckpt))
    qconf = transformers.FineGrainedFP8Config(weight_block_size=[16, 16],
                                               modules_to_not_convert=["self_attn"])
    op = Fp8Quantize(SimpleNamespace(quantization_config=qconf))
    state = load_file(str(ckpt / "model.safetensors"))
    out, deq = {}, dict(state)
    for name, t in state.items():
        if ".experts." in name:
            got = op.convert({name: t})
            q, inv = got[name], got[name.removesuffix("weight") + "weight_scale_inv"]
            assert q.dtype == FP8_DTYPE
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, inv
            deq[name] = q.float() * inv.repeat_interleave(16, 0).repeat_interleave(16, 1)
        else:
            out[name] = t
    save_file(out, str(ckpt / "model.safetensors"))
    cfg_file = ckpt / "config.json"
    hf_cfg = json.loads(cfg_file.read_text())
    hf_cfg["quantization_config"] = {**qconf.to_dict(), "quant_method": "fp8",
                                     "ignored_layers": ["re:.*self_attn.*"]}
    cfg_file.write_text(json.dumps(hf_cfg))
    ref = HF_CLASSES[arch](hf.config).eval()
    ref.save_pretrained(str(ref_dir))
    save_file(deq, str(ref_dir / "model.safetensors"))
    ref = HF_CLASSES[arch].from_pretrained(str(ref_dir)).eval()
    ours, cfg = _load(str(ckpt))
    assert cfg.model_config.quantization == "fp8"
    moe = next(m for m in ours.modules() if isinstance(m, FusedMoE))
    assert moe.w2_weight.dtype == FP8_DTYPE
    assert not hasattr(moe, "w13_weight_scale_inv")  # folded
    for p, got in zip(_prompts((33, 20), 5), _logits(ours, cfg, _prompts((33, 20), 5))):
        err = _rel_err(got, hf_logits_of(ref, p))
        print(f"\n{arch} weight_block_size [16, 16] folded: logits rel. error {err:.4f}")
        assert err < 0.06
    # A tensor-parallel rank whose intermediate slice is not whole blocks.
    from pagedllm.layers.quantization.fp8 import Fp8Config

    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\]"):
        FusedMoE(8, 2, 256, 768, True, tp_size=8, tp_rank=0,
                 quant_config=Fp8Config(serialized=True, block_size=(128, 128)),
                 prefix="model.layers.0.mlp.experts")


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_fp8_moe(arch: str, tmp_path) -> None:
    build(arch, str(tmp_path))
    model, cfg = _load(str(tmp_path), quantization="fp8", load_format="dummy")
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert moe.w13_weight.dtype == FP8_DTYPE
    assert float(moe.w13_weight_scale.min()) > 0
    assert all(torch.isfinite(x).all() for x in _logits(model, cfg, _prompts((9,), 1)))
