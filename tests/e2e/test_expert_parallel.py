"""MoE layers over two ranks through the whole engine on CPU (gloo, the ``mp`` executor):
``tensor_parallel_size=2`` with ``enable_expert_parallel`` (each rank holds half the
experts, whole) and without it (each rank holds half of every expert) give the same
greedy tokens as one rank on tiny random MoE checkpoints (Mixtral: 4 experts top-2,
renormalised; Qwen2-MoE: 6 experts top-2 with a gated shared expert and a dense layer;
DeepSeek-V3: 8 experts, grouped sigmoid routing with a correction bias, a shared expert,
MLA attention; DeepSeek-V2-Lite: softmax greedy routing), batched with chunked prefill;
and the bad configurations are refused naming ``enable_expert_parallel`` (or the size
that does not divide)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.models import deepseek_tiny
from tests.models.tiny_models import VOCAB, build

BUILDERS = {"mixtral": lambda p: build("mixtral", p),
            "qwen2_moe": lambda p: build("qwen2_moe", p),
            "deepseek_v3": lambda p: deepseek_tiny.build("v3", p),
            "deepseek_v2_lite": lambda p: deepseek_tiny.build("v2_lite", p)}

NEW = 8


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 30, 18)]


def _greedy(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32",
              max_model_len=64, max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 22,
              enable_prefix_caching=False, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_ep2_and_tp2_greedy_equal_one_rank(arch: str, tmp_path) -> None:
    path = str(tmp_path)
    BUILDERS[arch](path)
    ref = _greedy(path)
    assert _greedy(path, tensor_parallel_size=2, enable_expert_parallel=True) == ref
    assert _greedy(path, tensor_parallel_size=2) == ref


def test_bad_expert_parallel_configs_are_refused(tmp_path) -> None:
    moe, dense = str(tmp_path / "moe"), str(tmp_path / "dense")
    build("qwen2_moe", moe)  # 6 experts
    build("mistral_sw", dense)
    with pytest.raises(ValueError, match="enable_expert_parallel.*tensor_parallel_size"):
        EngineArgs(model=moe, device="cpu", enable_expert_parallel=True
                   ).create_engine_config()
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        EngineArgs(model=dense, device="cpu", tensor_parallel_size=2,
                   enable_expert_parallel=True).create_engine_config()
    with pytest.raises(ValueError, match="enable_expert_parallel: the model's 6 routed"):
        EngineArgs(model=moe, device="cpu", tensor_parallel_size=4,
                   enable_expert_parallel=True).create_engine_config()
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        EngineArgs(model=moe, device="cpu", tensor_parallel_size=2,
                   enable_expert_parallel="yes").create_engine_config()  # type: ignore[arg-type]
    cfg = EngineArgs(model=moe, device="cpu", tensor_parallel_size=2,
                     enable_expert_parallel=True).create_engine_config()
    assert cfg.parallel_config.enable_expert_parallel


def test_sliced_experts_must_divide() -> None:
    from types import SimpleNamespace

    from pagedllm.config import ParallelConfig
    from pagedllm.engine.arg_utils import check_parallel_shapes

    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, vocab_size=320, n_routed_experts=8,
                          moe_intermediate_size=30)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_parallel_shapes(cfg, ParallelConfig(tensor_parallel_size=4))
    check_parallel_shapes(cfg, ParallelConfig(tensor_parallel_size=4,
                                              enable_expert_parallel=True))


def test_cli_flag() -> None:
    import argparse

    from pagedllm.entrypoints.engine_cli_args import add_parallel_args

    p = argparse.ArgumentParser()
    add_parallel_args(p)
    assert p.parse_args(["--enable-expert-parallel"]).enable_expert_parallel
    assert not p.parse_args([]).enable_expert_parallel
