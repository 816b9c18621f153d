"""The seeded workloads of BENCHMARKS.md, drawn exactly in the documented order so every
engine sees the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def w1(num_requests: int = 256, seed: int = 0, vocab_hi: int = 128000,
       plen_range: tuple[int, int] = (128, 1024),
       olen_range: tuple[int, int] = (32, 512)) -> list[BenchRequest]:
    """W1 (and W2, W1-small with ``vocab_hi=49000``): plen 128..1024, olen 32..512."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        plen = rng.randint(*plen_range)
        olen = rng.randint(*olen_range)
        out.append(BenchRequest([rng.randrange(1000, vocab_hi) for _ in range(plen)], olen))
    return out


def w5(num_requests: int = 384) -> list[BenchRequest]:
    """W5 (long prompts): the W1 generator, seed 7, plen 64..2048, olen 16..768."""
    return w1(num_requests, seed=7, plen_range=(64, 2048), olen_range=(16, 768))


def w3(num_requests: int = 256, prefix_len: int = 2048, vocab_hi: int = 128000,
       output_len: int = 128) -> list[BenchRequest]:
    """W3: one shared prefix plus 32..128 unique tokens each, 128 output tokens."""
    rng = random.Random(3)
    prefix = [rng.randrange(1000, vocab_hi) for _ in range(prefix_len)]
    out = []
    for _ in range(num_requests):
        n = rng.randint(32, 128)
        out.append(BenchRequest(prefix + [rng.randrange(1000, vocab_hi) for _ in range(n)],
                                output_len))
    return out


def w4(seed: int, vocab_hi: int = 128000, prompt_len: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab_hi) for _ in range(prompt_len)]


_TOPICS = [
    "the water cycle", "black holes", "the French revolution", "photosynthesis",
    "machine learning", "the Roman empire", "volcanoes", "jazz music", "the human heart",
    "climate change", "the printing press", "quantum computing", "honey bees",
    "the Great Wall of China", "electric cars", "the Olympic games", "coral reefs",
    "the internet", "ancient Egypt", "vaccines", "the moon landing", "chess",
    "renewable energy", "the stock market", "dinosaurs", "coffee", "the Silk Road",
    "earthquakes", "Shakespeare", "the immune system", "rainbows", "bread baking",
]
_ASKS = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}, with one surprising fact.",
]


def c1_messages(num: int = 64) -> list[list[dict[str, Any]]]:
    """C1: 64 different single-turn chat prompts (30-50 tokens with SmolLM2's template)."""
    convs = []
    for i in range(num):
        ask = _ASKS[(i // len(_TOPICS)) % len(_ASKS)]
        convs.append([{"role": "user", "content": ask.format(t=_TOPICS[i % len(_TOPICS)])}])
    return convs


def totals(reqs: list[BenchRequest]) -> tuple[int, int]:
    return sum(len(r.prompt_token_ids) for r in reqs), sum(r.output_len for r in reqs)


# The model shapes of BENCHMARKS.md, for dummy-weight runs (no weights needed).
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    # A draft for llama3-8b (same vocabulary; speculative_config "draft_model").
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    # EAGLE heads for llama3-8b (speculative_config "eagle" / "eagle3"; the published
    # yuhuili/EAGLE-LLaMA3-Instruct-8B and EAGLE3-LLaMA3.1-Instruct-8B shapes).
    "eagle-llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    "eagle3-llama3-8b": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "draft_vocab_size": 32000, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2},
    # MoE: 128 experts, top-8 (issue 23's target shape).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645},
    # MoE: 8 experts, top-2.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2},
    # Hybrid attention: 5 sliding (window 1024) : 1 global, head_dim 256.
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(48)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                               "factor": 8.0}},
        "vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1},
}


def _ct_config(weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` as llmcompressor writes it: one group
    over every ``Linear``, lm_head left in the model dtype."""
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None, "format": fmt}}}


def _w4a16(group: int) -> dict[str, Any]:
    return _ct_config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                       "group_size": group, "dynamic": False, "actorder": None},
                      None, "pack-quantized")


_W8A8_INT8 = _ct_config({"num_bits": 8, "type": "int", "symmetric": True,
                         "strategy": "channel", "dynamic": False},
                        {"num_bits": 8, "type": "int", "symmetric": True,
                         "strategy": "token", "dynamic": True}, "int-quantized")
# Integer-checkpoint variants of two shapes (issue 21): the dummy loader fills their
# packed layout, so these benchmark the W4A16 / W8A8-INT8 kernels end to end.  Group 128
# (the issue's layout) for the 8B shape; SmolLM2's 576-wide inputs take group 64.
for _base, _group in (("llama3-8b", 128), ("smollm2-135m", 64)):
    DUMMY_CONFIGS[f"{_base}-w4a16"] = {**DUMMY_CONFIGS[_base],
                                       "quantization_config": _w4a16(_group)}
    DUMMY_CONFIGS[f"{_base}-w8a8-int8"] = {**DUMMY_CONFIGS[_base],
                                           "quantization_config": _W8A8_INT8}


def write_dummy_model(name: str, directory: str | None = None) -> str:
    """Write ``config.json`` for a named shape into a (temporary) directory; load it with
    ``load_format="dummy"``."""
    import json
    import os
    import tempfile

    if name not in DUMMY_CONFIGS:
        raise ValueError(f"dummy model must be one of {', '.join(DUMMY_CONFIGS)}, got {name!r}")
    d = directory or tempfile.mkdtemp(prefix=f"pagedllm-{name}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(DUMMY_CONFIGS[name], f)
    return d


def engine_summary(llm: Any) -> dict[str, Any]:
    """What ran, for a benchmark's header and JSON: the weights' quantisation, the KV
    cache's element type and blocks, the scheduling policy."""
    cfg = llm.llm_engine.config
    core = getattr(getattr(llm.llm_engine, "client", None), "core", None)
    blocks = getattr(core, "num_blocks", None) or cfg.cache_config.num_blocks
    groups = cfg.cache_config.kv_cache_groups
    return {"dtype": cfg.model_config.dtype,
            "quantization": cfg.model_config.quantization or "none",
            "kv_cache_dtype": cfg.cache_config.cache_dtype,
            "kv_blocks": blocks, "kv_block_bytes": kv_block_bytes(llm),
            "kv_cache_groups": groups.describe() if groups is not None else None,
            "scheduling_policy": cfg.scheduler_config.policy}


def kv_block_bytes(llm: Any) -> int:
    """Bytes of one KV block (all ranks): a page of every layer, or with hybrid KV cache
    groups of one group's layers (``core/kv_cache_groups.py``)."""
    cfg = llm.llm_engine.config
    mc, cc = cfg.model_config, cfg.cache_config
    per_block = mc.kv_bytes_per_token(cc.cache_dtype) * cc.block_size
    groups = cc.kv_cache_groups
    if groups is not None and groups.hybrid:
        per_block = per_block * groups.num_tensors // mc.num_layers
    return per_block


def kv_peak_tracker(llm: Any) -> Any:
    """The in-process scheduler, whose KV pool and queues record their peaks (None when
    the engine core runs in another process)."""
    core = getattr(getattr(llm.llm_engine, "client", None), "core", None)
    return getattr(core, "scheduler", None)


def summary_line(s: dict[str, Any]) -> str:
    blocks = f", {s['kv_blocks'] - 1} KV blocks" if s.get("kv_blocks") else ""
    if s.get("kv_block_bytes"):
        blocks += f" of {s['kv_block_bytes'] / 2**20:.2f} MiB"
    groups = f"; {s['kv_cache_groups']}" if s.get("kv_cache_groups") else ""
    policy = f", {s['scheduling_policy']} policy" if s.get("scheduling_policy") else ""
    return (f"dtype {s['dtype']}, quantization {s['quantization']}, kv_cache_dtype "
            f"{s['kv_cache_dtype']}{blocks}{groups}{policy}")

