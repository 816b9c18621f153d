"""Our Llama / Qwen2 / Qwen3 vs transformers' own classes on tiny random checkpoints.

Each config is saved by transformers (``save_pretrained``, safetensors), loaded through
``load_model`` and run through the paged KV cache: the whole prompt as one request, the
prompt as chunks followed by single-token decodes, and several requests mixed in one
batch.  Logits must match HF's full-sequence forward (fp32, CPU).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession, hf_logits_of, session_for

ATOL = 1e-4

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)

CONFIGS = {
    # GQA 4:1, untied head, llama3 rope scaling (original context 64 < prompt positions).
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        architectures=["LlamaForCausalLM"]),
    # q/k/v bias, tied embeddings, GQA 2:1.
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        architectures=["Qwen2ForCausalLM"]),
    # q/k norm and head_dim (32) != hidden / heads (16); no GQA.
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"]),
}
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF zero-inits biases and one-inits norms; randomise everything so a weight loaded
    into the wrong place (or not at all) changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(our model, HF model, engine config) for one architecture."""
    arch = request.param
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](CONFIGS[arch]()).eval()
    _randomize(hf, seed=len(arch))
    path = str(tmp_path_factory.mktemp(arch))
    hf.save_pretrained(path, safe_serialization=True)
    assert any(f.endswith(".safetensors") for f in os.listdir(path))
    cfg = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config()
    ours = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    return ours, hf, cfg


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_whole_prompt(pair) -> None:
    ids = _prompt(70, seed=1)
    got = session_for(pair).step({0: ids})[0]
    torch.testing.assert_close(got, hf_logits_of(pair[1], ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunks_then_decodes(pair, block_size: int) -> None:
    ids = _prompt(45, seed=2)
    s = session_for(pair, block_size=block_size, seed=block_size)
    parts = [s.step({7: ids[:13]})[7], s.step({7: ids[13:30]})[7]]
    parts += [s.step({7: [t]})[7] for t in ids[30:]]
    torch.testing.assert_close(torch.cat(parts), hf_logits_of(pair[1], ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batch(pair, backend: str) -> None:
    """Prefills, chunks-with-context and decodes of different requests in the same steps.
    ``triton``: the GPU backend (interpreted on CPU), whose rotary is fused into its KV
    write -- the model hands it unrotated q/k."""
    prompts = {r: _prompt(n, seed=10 + r) for r, n in enumerate([33, 20, 9, 50])}
    if backend == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")

        _, hf, cfg = pair
        ours = load_model(cfg.model_config, torch.device("cpu"), TritonAttentionBackend())
        mc = cfg.model_config
        s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48,
                         seed=3)
    else:
        s = session_for(pair, seed=3)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in prompts}
    schedule = [
        {0: (0, 33), 1: (0, 7), 2: (0, 1)},
        {1: (7, 19), 2: (1, 2), 3: (0, 16)},
        {1: (19, 20), 2: (2, 9), 3: (16, 40)},
        {3: (40, 41)},
        {3: (41, 50)},
    ]
    for step in schedule:
        out = s.step({r: prompts[r][a:b] for r, (a, b) in step.items()})
        for r, logits in out.items():
            got[r].append(logits)
    for r, ids in prompts.items():
        torch.testing.assert_close(torch.cat(got[r]), hf_logits_of(pair[1], ids), atol=ATOL,
                                   rtol=0)


def test_last_only_keeps_each_requests_last_token(pair) -> None:
    """``last_only``: the last layer runs past attention only on each request's last
    token; those rows' logits still equal HF's, and the KV the skipped rows wrote is the
    full forward's (a later decode over it matches too)."""
    prompts = {r: _prompt(n, seed=20 + r) for r, n in enumerate([26, 1, 14])}
    s = session_for(pair, seed=4)
    steps = [{0: (0, 10), 1: (0, 1), 2: (0, 14)}, {0: (10, 26), 1: (1, 1)}]
    got: dict[int, torch.Tensor] = {}
    for step in steps:
        todo = {r: prompts[r][a:b] for r, (a, b) in step.items() if b > a}
        for r, logits in s.step(todo, last_only=True).items():
            assert logits.shape[0] == 1
            got[r] = logits[0]
    for r, ids in prompts.items():
        torch.testing.assert_close(got[r], hf_logits_of(pair[1], ids)[-1], atol=ATOL, rtol=0)
    # One decode token each on top (max_query_len 1: no rows dropped).
    nxt = {r: [int(got[r].argmax())] for r in prompts}
    out = s.step(nxt, last_only=True)
    for r, ids in prompts.items():
        ref = hf_logits_of(pair[1], ids + nxt[r])[-1]
        torch.testing.assert_close(out[r][0], ref, atol=ATOL, rtol=0)


def test_batch1_decodes_on_the_gemv_path(pair, monkeypatch) -> None:
    """Batch-1 decode steps through the GEMV kernels (``kernels/gemv.py``, interpreted on
    CPU): every projection, and down_proj with SiLU-and-mul fused into its input read.
    On the GPU this path is chosen for one-row bf16/fp16 batches; here it is forced for
    fp32 CPU rows so that CI checks the model's wiring against HF."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    from pagedllm.kernels import gemv as gemv_mod
    from pagedllm.layers.quantization import unquantized
    from pagedllm.models import llama

    calls = {"plain": 0, "silu_mul": 0}
    real_gemv = gemv_mod.gemv

    def counting_gemv(*args, **kw):  # type: ignore[no-untyped-def]
        calls["silu_mul" if kw.get("silu_mul") else "plain"] += 1
        return real_gemv(*args, **kw)

    def one_row(x: torch.Tensor, weight_or_layer: object) -> bool:
        return x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()

    monkeypatch.setattr(unquantized, "gemv_shape", one_row)
    monkeypatch.setattr(llama, "gemv_applies", one_row)
    monkeypatch.setattr(gemv_mod, "gemv", counting_gemv)
    ids = _prompt(30, seed=6)
    s = session_for(pair, seed=6)
    # 3 decode steps (each a full set of GEMV launches; more would repeat them).
    parts = [s.step({5: ids[:27]})[5]] + [s.step({5: [t]})[5] for t in ids[27:]]
    torch.testing.assert_close(torch.cat(parts), hf_logits_of(pair[1], ids), atol=ATOL, rtol=0)
    layers = pair[2].model_config.num_layers
    assert calls == {"plain": 3 * layers * 3, "silu_mul": 3 * layers}, calls


def test_compute_logits_only_given_rows(pair) -> None:
    ours, _, cfg = pair
    h = torch.randn(3, cfg.model_config.hf_config.hidden_size)
    with torch.inference_mode():
        logits = ours.compute_logits(h)
    assert logits.shape == (3, cfg.model_config.vocab_size)
    assert logits.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_transformers(pair, dtype: str) -> None:
    """The same checkpoint built on the GPU: fp32 within float noise, bf16 loosely."""
    _, hf, cfg = pair
    import dataclasses

    mc = dataclasses.replace(cfg.model_config, dtype=dtype)
    ours = load_model(mc, torch.device("cuda"), TorchReferenceBackend())
    torch_dtype = getattr(torch, dtype)
    ids = _prompt(40, seed=5)
    s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16,
                     dtype=torch_dtype, device="cuda")
    got = torch.cat([s.step({0: ids[:25]})[0]] + [s.step({0: [t]})[0] for t in ids[25:]])
    ref = hf_logits_of(hf, ids)
    tol = 1e-3 if dtype == "float32" else 0.15
    torch.testing.assert_close(got.cpu(), ref, atol=tol, rtol=0)


@pytest.mark.gpu
def test_dummy_8b_shape_builds_fast_on_gpu(tmp_path) -> None:
    import time

    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    ec = EngineArgs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                    load_format="dummy").create_engine_config()
    t0 = time.perf_counter()
    model = load_model(ec.model_config, torch.device("cuda"), TorchReferenceBackend())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    assert 7.5e9 < n < 8.5e9
    assert elapsed < 20, f"dummy 8B build took {elapsed:.1f}s"
    del model
    torch.cuda.empty_cache()
