"""``calculate_kv_scales`` (layers/kv_scales.py): with an fp8 KV cache each attention
layer's k/v scales come from the first real batch (amax / 200 for keys, / 100 for
values, as vLLM), stay frozen afterwards, and are not taken from the start-up's dummy
forwards; the flag is validated and reaches the engine from the CLI."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli
from pagedllm.layers.attention import Attention
from pagedllm.layers.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from tests.layers.fp8_fixtures import tiny_llama


def _attn_layers(llm: LLM) -> list[Attention]:
    model = llm.llm_engine.client.core.executor.worker.model
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_kv"))
    tiny_llama(seed=5).save_pretrained(path)
    return path


def test_scales_from_first_batch_then_frozen(model_dir: str) -> None:
    llm = LLM(model_dir, skip_tokenizer_init=True, device="cpu", kv_cache_dtype="fp8",
              calculate_kv_scales=True, kv_cache_memory_bytes=4 << 20, max_model_len=128)
    layers = _attn_layers(llm)
    assert layers and all(a.k_scale == 1.0 and a.v_scale == 1.0 for a in layers)
    seen: dict[int, tuple[float, float]] = {}

    def capture(mod, args, kwargs):  # the keys/values the layer gets, as it stores them
        q, k, v, meta = args[:4]
        rope = args[4] if len(args) > 4 else kwargs.get("rope")
        n = meta.num_actual_tokens
        k3 = k.view(k.shape[0], mod.num_kv_heads, mod.head_dim)
        keys = rope.rotate(k3)[:n] if rope is not None else k3[:n]
        seen.setdefault(id(mod), (float(keys.abs().max()), float(v[:n].abs().max())))

    hooks = [a.register_forward_pre_hook(capture, with_kwargs=True) for a in layers]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 42, 7]}], greedy)
    for h in hooks:
        h.remove()
    assert len(first[0].outputs[0].token_ids) == 4
    scales = [(a.k_scale, a.v_scale) for a in layers]
    for a in layers:
        k_amax, v_amax = seen[id(a)]
        assert a.k_scale == pytest.approx(k_amax / K_SCALE_CONSTANT, rel=1e-6)
        assert a.v_scale == pytest.approx(v_amax / V_SCALE_CONSTANT, rel=1e-6)
        assert not a.calculate_kv_scales
    # Later batches (other tokens, other ranges) leave them as they are.
    llm.generate([{"prompt_token_ids": list(range(100, 140))}], greedy)
    assert [(a.k_scale, a.v_scale) for a in layers] == scales


def test_off_keeps_default_scales(model_dir: str) -> None:
    llm = LLM(model_dir, skip_tokenizer_init=True, device="cpu", kv_cache_dtype="fp8",
              kv_cache_memory_bytes=4 << 20, max_model_len=128)
    llm.generate([{"prompt_token_ids": [5, 17, 99]}], SamplingParams(max_tokens=2))
    assert all(a.k_scale == 1.0 and a.v_scale == 1.0 for a in _attn_layers(llm))


def test_flag_validation_and_cli(model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"calculate_kv_scales must be a bool, got 'yes'"):
        EngineArgs(model=model_dir, device="cpu", kv_cache_dtype="fp8",
                   calculate_kv_scales="yes").create_engine_config()  # type: ignore[arg-type]
    # Only an fp8 cache has scales: with the model dtype's cache the flag does nothing.
    cfg = EngineArgs(model=model_dir, device="cpu",
                     calculate_kv_scales=True).create_engine_config()
    assert not cfg.cache_config.calculate_kv_scales
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", model_dir, "--kv-cache-dtype", "fp8",
                         "--calculate-kv-scales"])
    cfg = engine_args_from_cli(args).create_engine_config()
    assert cfg.cache_config.calculate_kv_scales
    assert not engine_args_from_cli(p.parse_args(["--model", model_dir])).calculate_kv_scales
