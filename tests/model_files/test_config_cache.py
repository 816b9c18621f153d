"""The cached model config (``model_files/config_cache.py``) stands for transformers'
config exactly: for every architecture the tests build (tiny random checkpoints, the
benchmark shapes, the vision-language models, the default GGUF), every public attribute,
property and class attribute of the config transformers loads has the same value and
type on the view read back from the cache, sub-configs included.  A fresh process then
builds the engine config without importing transformers, and equal to the one built
through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers
from transformers import AutoConfig, PretrainedConfig

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, write_dummy_model
from pagedllm.model_files import config_cache
from pagedllm.model_files.resolve import resolve_model
from tests.models import deepseek_tiny, tiny_gemma3, tiny_models, tiny_qwen_vl, tiny_vlms

ROOT = Path(__file__).resolve().parents[2]


def _configs() -> dict[str, object]:
    out: dict[str, object] = {f"tiny-{k}": v for k, v in tiny_models.CONFIGS.items()}
    out.update({f"deepseek-{k}": v for k, v in deepseek_tiny.CONFIGS.items()})
    out["llama"] = lambda: transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)
    out["gemma3-vlm"] = lambda: tiny_gemma3.gemma3_config(tiny_gemma3.make_tokenizer())
    tok = tiny_qwen_vl.make_tokenizer
    out["qwen2-vl"] = lambda: tiny_qwen_vl.qwen2_vl_config(tok())
    out["qwen2.5-vl"] = lambda: tiny_qwen_vl.qwen2_5_vl_config(tok())
    out["llava-clip"] = lambda: tiny_vlms.llava_config(320, 300, "clip")
    out["llava-siglip"] = lambda: tiny_vlms.llava_config(320, 300, "siglip")
    return out


def assert_same(real: PretrainedConfig, view: object, where: str) -> None:
    """Every public non-method attribute of ``real`` reads the same on ``view``."""
    assert isinstance(view, config_cache.ConfigView), where
    assert view.config_class == type(real).__name__
    for name in dir(real):
        if name.startswith("_"):
            continue
        try:
            expected = getattr(real, name)
        except Exception:  # a property that raises: the view has no such attribute
            with pytest.raises(AttributeError):
                getattr(view, name)
            continue
        if isinstance(expected, PretrainedConfig):
            assert_same(expected, getattr(view, name), f"{where}.{name}")
            continue
        if callable(expected):  # methods (and classes in sub_configs)
            continue
        if name in view._missing:  # documented: loud on access
            with pytest.raises(NotImplementedError):
                getattr(view, name)
            continue
        got = getattr(view, name)
        assert got == expected and type(got) is type(expected), \
            f"{where}.{name}: {got!r} != {expected!r}"


@pytest.mark.parametrize("name", sorted(_configs()))
def test_view_equals_transformers_config(name: str, tmp_path) -> None:
    _configs()[name]().save_pretrained(tmp_path)
    real = AutoConfig.from_pretrained(tmp_path)  # as the engine loads it
    view = config_cache.ConfigView(json.loads(json.dumps(config_cache.snapshot(real))))
    assert_same(real, view, name)
    # Writes go where transformers' would (attribute_map aliases included).
    for alias, target in real.attribute_map.items():
        setattr(view, alias, 7)
        assert getattr(view, target) == 7


@pytest.mark.parametrize("shape", sorted(DUMMY_CONFIGS))
def test_view_equals_for_every_benchmark_shape(shape: str, tmp_path) -> None:
    real = AutoConfig.from_pretrained(write_dummy_model(shape, str(tmp_path)))
    view = config_cache.ConfigView(json.loads(json.dumps(config_cache.snapshot(real))))
    assert_same(real, view, shape)


def test_default_gguf_config_round_trips(default_model_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    resolved = resolve_model(default_model_path, None, "auto")
    real = resolved.load_hf_config()  # built (transformers is loaded here) and cached
    key = resolved._config_cache_key()
    view = config_cache.load(key)
    assert view is not None and os.path.isfile(
        os.path.join(config_cache.cache_root(), key + ".json"))
    assert_same(real, view, "default gguf")


def test_a_fresh_process_builds_the_engine_config_without_transformers(
        tmp_path, monkeypatch) -> None:
    cache, model = tmp_path / "cache", tmp_path / "model"
    model.mkdir()
    write_dummy_model("llama3-8b", str(model))
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    script = textwrap.dedent(f"""
        import sys
        from pagedllm.engine.arg_utils import EngineArgs
        cfg = EngineArgs(model={str(model)!r}, load_format="dummy",
                         device="cpu").create_engine_config()
        mc = cfg.model_config
        print(type(mc.hf_config).__name__, "transformers" in sys.modules,
              mc.max_model_len, mc.kv_bytes_per_token("auto"), mc.hf_config.model_type)
    """)

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        return out.stdout.split()

    first, second = run(), run()  # the first builds through transformers and caches
    assert first[:2] == ["LlamaConfig", "True"]
    assert second[:2] == ["ConfigView", "False"]
    # max_model_len, KV bytes a token (32 layers x K, V x 8 heads x 128 x fp32), type
    assert first[2:] == second[2:] == ["8192", str(32 * 2 * 8 * 128 * 4), "llama"]


def test_unstorable_configs_and_remote_code_are_not_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    cfg = transformers.LlamaConfig(num_hidden_layers=1)
    cfg.custom = object()  # a public value no snapshot can hold
    config_cache.save("k", cfg)
    assert config_cache.load("k") is None
    model = tmp_path / "m"
    model.mkdir()
    write_dummy_model("llama3-8b", str(model))
    resolve_model(str(model), None, "dummy").load_hf_config(trust_remote_code=True)
    assert not os.path.isdir(config_cache.cache_root()) or \
        not os.listdir(config_cache.cache_root())


def test_a_copied_config_json_is_not_served_the_original_directory(
        tmp_path, monkeypatch) -> None:
    """transformers records the directory a config came from (``name_or_path``); the
    view of a byte-identical config.json elsewhere must not report the first one's."""
    import shutil

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    write_dummy_model("llama3-8b", str(a))
    shutil.copytree(a, b)
    assert resolve_model(str(a), None, "dummy").load_hf_config().name_or_path == str(a)
    monkeypatch.setattr(config_cache, "transformers_loaded", lambda: False)
    view = resolve_model(str(a), None, "dummy").load_hf_config()
    assert isinstance(view, config_cache.ConfigView) and view.name_or_path == str(a)
    other = resolve_model(str(b), None, "dummy").load_hf_config()
    assert other.name_or_path == str(b)
