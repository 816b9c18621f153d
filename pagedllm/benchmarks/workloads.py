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
    # V1: the request's images (PIL), whose placeholder runs are expanded in the ids.
    images: list[Any] | None = None

    @property
    def prompt(self) -> Any:
        """What ``LLM.generate`` takes: the ids, with ``multi_modal_data`` for images."""
        if not self.images:
            return self.prompt_token_ids
        return {"prompt_token_ids": self.prompt_token_ids,
                "multi_modal_data": {"image": self.images}}


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


def synthetic_image(seed: int, size: int = 448) -> Any:
    """A ``size`` x ``size`` RGB image of seeded uniform noise (PIL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def v1(image_run: list[int], num_requests: int = 256, vocab_hi: int = 128000,
       text_range: tuple[int, int] = (64, 256), output_len: int = 128,
       image_size: int = 448, repeat_image: bool = False) -> list[BenchRequest]:
    """V1 (vision-language throughput, issue 41): per request one ``image_size``-square
    noise image (``synthetic_image(i)``; every request image 0 with ``repeat_image``),
    then text.  ``rng = random.Random(0)``; per request ``tlen = rng.randint(64, 256)``,
    then ``tlen`` ids ``rng.randrange(1000, vocab_hi)``.  Prompt ids: ``image_run`` (the
    model's image placeholder run, expanded: Qwen2.5-VL's ``<|vision_start|>``, 256
    ``<|image_pad|>`` for 448x448, ``<|vision_end|>``) followed by the text."""
    rng = random.Random(0)
    shared = synthetic_image(0, image_size) if repeat_image else None
    out = []
    for i in range(num_requests):
        tlen = rng.randint(*text_range)
        text = [rng.randrange(1000, vocab_hi) for _ in range(tlen)]
        image = shared if shared is not None else synthetic_image(i, image_size)
        out.append(BenchRequest(list(image_run) + text, output_len, [image]))
    return out


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
    # Phi-4 (14B): microsoft/phi-4's config.json (Llama's graph, fused qkv / gate_up in
    # the checkpoint, 40 / 10 KV heads of 128; BENCHMARKS.md has no Phi config).
    "phi-4-14b": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 5120,
        "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 10, "hidden_act": "silu", "vocab_size": 100352,
        "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
        "rope_theta": 250000.0, "rope_scaling": None, "rms_norm_eps": 1e-05,
        "sliding_window": None, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 100257, "eos_token_id": 100265,
        "pad_token_id": 100349},
    # MLA + DeepSeekMoE (issue 42): BENCHMARKS.md's DeepSeek-V2-Lite config, verbatim.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "vocab_size": 102400, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001},
    # Vision-language (issue 41): Qwen2.5-VL-7B-Instruct's config.json (the hub's flat
    # layout); ``write_dummy_model`` also saves a processor for it (dummy_processor.py).
    "qwen2.5-vl-7b": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
        "vocab_size": 152064, "max_position_embeddings": 128000, "max_window_layers": 28,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope",
                                                  "mrope_section": [16, 24, 24]},
        "rms_norm_eps": 1e-06, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280,
            "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
            "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
            "temporal_patch_size": 2}},
}
# The VLM's language model alone (Qwen2.5-VL-7B's decoder = Qwen2.5-7B's shape): W1 on
# both checks that a VLM's text-only throughput equals its LM's (issue 41).
DUMMY_CONFIGS["qwen2.5-7b"] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    **{k: v for k, v in DUMMY_CONFIGS["qwen2.5-vl-7b"].items()
       if k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "hidden_act", "vocab_size",
                "max_position_embeddings", "max_window_layers", "rope_theta",
                "rms_norm_eps", "sliding_window", "use_sliding_window",
                "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id")}}


def _ct_config(weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` as llmcompressor writes it: one group
    over every ``Linear``, lm_head left in the model dtype."""
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None, "format": fmt}}}


def _w4a16(group: int, symmetric: bool = True) -> dict[str, Any]:
    return _ct_config({"num_bits": 4, "type": "int", "symmetric": symmetric,
                       "strategy": "group", "group_size": group, "dynamic": False,
                       "actorder": None}, None, "pack-quantized")


def _awq(group: int) -> dict[str, Any]:
    """AutoAWQ's GEMM config (``awq.py``): 4-bit codes with zero points."""
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm"}


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
    # Zero points (issue 43): compressed-tensors asymmetric and AWQ, whose dummy loader
    # fills the packed zeros at random -- the path every AWQ checkpoint takes.
    DUMMY_CONFIGS[f"{_base}-w4a16-asym"] = {**DUMMY_CONFIGS[_base],
                                            "quantization_config": _w4a16(_group, False)}
    DUMMY_CONFIGS[f"{_base}-awq"] = {**DUMMY_CONFIGS[_base],
                                     "quantization_config": _awq(_group)}


def dummy_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A named shape's config, with ``overrides`` merged over it (one level into dict
    values such as ``vision_config``): ``--dummy-overrides`` shrinks a shape for a CPU
    smoke run of the same code path."""
    if name not in DUMMY_CONFIGS:
        raise ValueError(f"dummy model must be one of {', '.join(DUMMY_CONFIGS)}, got {name!r}")
    cfg = dict(DUMMY_CONFIGS[name])
    for k, v in (overrides or {}).items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) \
            else v
    return cfg


def add_dummy_overrides_arg(p: Any) -> None:
    """``--dummy-overrides JSON`` on a benchmark's parser (with ``--dummy``)."""
    import json

    p.add_argument("--dummy-overrides", type=json.loads, default=None, metavar="JSON",
                   help="With --dummy: config keys to replace in the shape, e.g. "
                        "'{\"num_hidden_layers\": 2}' (dict values such as vision_config "
                        "merge one level deep); shrinks a shape for a CPU smoke run.")


def write_dummy_model(name: str, directory: str | None = None,
                      overrides: dict[str, Any] | None = None) -> str:
    """Write ``config.json`` for a named shape into a (temporary) directory; load it with
    ``load_format="dummy"``.  A vision-language shape also gets a processor (image
    processor + a stand-in tokenizer with the family's special tokens, built offline:
    ``dummy_processor.py``), which its image requests need even with token-id prompts."""
    import json
    import os
    import tempfile

    cfg = dummy_config(name, overrides)
    d = directory or tempfile.mkdtemp(prefix=f"pagedllm-{name}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    if "vision_config" in cfg:
        from pagedllm.benchmarks.dummy_processor import write_dummy_processor

        write_dummy_processor(d, cfg)
    return d


def engine_summary(llm: Any) -> dict[str, Any]:
    """What ran, for a benchmark's header and JSON: the weights' quantisation, the KV
    cache's element type and blocks, the scheduling policy."""
    cfg = llm.llm_engine.config
    core = getattr(getattr(llm.llm_engine, "client", None), "core", None)
    blocks = getattr(core, "num_blocks", None) or cfg.cache_config.num_blocks
    groups = cfg.cache_config.kv_cache_groups
    mc = cfg.model_config
    out = {"dtype": mc.dtype,
           "quantization": mc.quantization or "none",
           "kv_cache_dtype": cfg.cache_config.cache_dtype,
           "kv_blocks": blocks, "kv_block_bytes": kv_block_bytes(llm),
           "kv_bytes_per_token": mc.kv_bytes_per_token(cfg.cache_config.cache_dtype),
           "kv_cache_groups": groups.describe() if groups is not None else None,
           "scheduling_policy": cfg.scheduler_config.policy}
    if mc.use_mla and blocks:
        out["gqa_equivalent"] = gqa_equivalent(llm, blocks)
    return out


def gqa_equivalent(llm: Any, blocks: int) -> dict[str, Any]:
    """An MLA model's KV cache against the same model storing per-head keys and values
    (DeepSeek-V2's own comparison: K and V of ``num_key_value_heads`` heads of
    ``qk_nope_head_dim``, every layer): bytes per token, and the blocks the same memory
    would hold."""
    cfg = llm.llm_engine.config
    mc, cc = cfg.model_config, cfg.cache_config
    hf = mc.hf_config
    heads, dim = int(hf.num_key_value_heads), int(hf.qk_nope_head_dim)
    elem = mc.kv_bytes_per_token(cc.cache_dtype) // (mc.num_layers * mc.head_dim)
    per_token = 2 * mc.num_layers * heads * dim * elem
    mla_per_token = mc.kv_bytes_per_token(cc.cache_dtype)
    return {"kv_heads": heads, "head_dim": dim, "kv_bytes_per_token": per_token,
            "kv_blocks": blocks * mla_per_token // per_token,
            "mla_saving": per_token / mla_per_token}


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


def inproc_runner(llm: Any) -> Any:
    """The ``ModelRunner`` of ``llm``'s engine when its worker runs in this process (the
    uniprocess executor), else None."""
    core = getattr(getattr(llm.llm_engine, "client", None), "core", None)
    worker = getattr(getattr(core, "executor", None), "worker", None)
    return getattr(worker, "runner", None)


def kv_peak_tracker(llm: Any) -> Any:
    """The in-process scheduler, whose KV pool and queues record their peaks (None when
    the engine core runs in another process)."""
    core = getattr(getattr(llm.llm_engine, "client", None), "core", None)
    return getattr(core, "scheduler", None)


def summary_line(s: dict[str, Any]) -> str:
    blocks = f", {s['kv_blocks'] - 1} KV blocks" if s.get("kv_blocks") else ""
    if s.get("kv_block_bytes"):
        blocks += f" of {s['kv_block_bytes'] / 2**20:.2f} MiB"
    if s.get("kv_bytes_per_token"):
        blocks += f", {s['kv_bytes_per_token']:,} KV bytes/token"
    g = s.get("gqa_equivalent")
    if g:
        blocks += (f" (as GQA with {g['kv_heads']} KV heads of {g['head_dim']}: "
                   f"{g['kv_bytes_per_token']:,} bytes/token, {g['kv_blocks'] - 1} blocks; "
                   f"MLA holds {g['mla_saving']:.1f}x the tokens)")
    groups = f"; {s['kv_cache_groups']}" if s.get("kv_cache_groups") else ""
    policy = f", {s['scheduling_policy']} policy" if s.get("scheduling_policy") else ""
    return (f"dtype {s['dtype']}, quantization {s['quantization']}, kv_cache_dtype "
            f"{s['kv_cache_dtype']}{blocks}{groups}{policy}")

