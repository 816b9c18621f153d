"""Smoke runs of the GPU benchmarks of issues 41 and 42 on the CPU, at tiny sizes: the
same commands as on the device (``docs/benchmarks.md``), with the shapes shrunk by
``--dummy-overrides`` (or a directory ``write_dummy_model`` wrote with overrides).  Only
the reports' fields and counts are checked, never a time."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, dummy_config, write_dummy_model
from pagedllm.entrypoints.cli import main

# DeepSeek-V2-Lite's structure (MLA without query LoRA, yarn, a dense first layer, then
# DeepSeekMoE with shared experts) at test width.
TINY_DEEPSEEK = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                 "v_head_dim": 12, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}
# Qwen2.5-VL-7B's structure (window + full vision blocks, M-RoPE decoder, the real
# vocabulary and image token ids) at test width.
TINY_QWEN_TEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 2048}
TINY_QWEN_VL = {**TINY_QWEN_TEXT,
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48,
                                  "num_heads": 4, "out_hidden_size": 64,
                                  "fullatt_block_indexes": [1]}}
SMALL = ["--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "2048"]


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "report.json"
    assert main(["bench", *args, *SMALL, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A shrunk Qwen2.5-VL-7B directory with its offline processor, written once."""
    return write_dummy_model("qwen2.5-vl-7b", str(tmp_path_factory.mktemp("vlm")),
                             overrides=TINY_QWEN_VL)


def test_the_dummy_vlm_tokenizer_has_qwens_ids(tiny_vlm: str) -> None:
    from pagedllm.multimodal.hf_processor import load_hf_processor

    tok = load_hf_processor(tiny_vlm).tokenizer
    assert len(tok) == 151665
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|vision_start|>",
                                      "<|image_pad|>"]) == [151643, 151645, 151652, 151655]
    ids = tok("t5 <|vision_start|><|image_pad|><|vision_end|> t7",
              add_special_tokens=False)["input_ids"]
    assert ids == [5, 151652, 151655, 151653, 7]


def test_the_shapes_are_benchmarks_md() -> None:
    ds = DUMMY_CONFIGS["deepseek-v2-lite"]
    assert (ds["num_hidden_layers"], ds["hidden_size"], ds["kv_lora_rank"],
            ds["qk_rope_head_dim"], ds["n_routed_experts"], ds["num_experts_per_tok"],
            ds["n_shared_experts"], ds["vocab_size"]) == (27, 2048, 512, 64, 64, 6, 2, 102400)
    vl, lm = DUMMY_CONFIGS["qwen2.5-vl-7b"], DUMMY_CONFIGS["qwen2.5-7b"]
    for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size",
              "intermediate_size", "rope_theta"):
        assert vl[k] == lm[k], k  # the VLM's decoder is the LM alone
    # Overrides merge one level into dicts: the tower keeps its patch and merge sizes.
    shrunk = dummy_config("qwen2.5-vl-7b", TINY_QWEN_VL)["vision_config"]
    assert (shrunk["depth"], shrunk["patch_size"], shrunk["spatial_merge_size"]) == (2, 14, 2)


def test_deepseek_throughput_reports_kv_against_gqa(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    report = _bench(tmp_path, "throughput", "--dummy", "deepseek-v2-lite",
                    "--dummy-overrides", json.dumps(TINY_DEEPSEEK), "--workload", "custom",
                    "--input-len", "24", "--output-len", "3", "--num-prompts", "2",
                    "--batch-sizes", "2", "--no-hf")
    meta = report["meta"]
    # One latent entry of kv_lora_rank + rope per layer, fp32 on the CPU.
    assert meta["kv_bytes_per_token"] == 2 * (32 + 8) * 4
    gqa = meta["gqa_equivalent"]
    assert gqa["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 4  # K and V, 4 heads of 16
    assert gqa["kv_blocks"] == meta["kv_blocks"] * 320 // 1024
    assert gqa["mla_saving"] == pytest.approx(1024 / 320)
    assert report["rows"][0]["output_tokens"] == 6
    assert "MLA holds 3.2x the tokens" in capsys.readouterr().out


def test_w1_for_deepseeks_vocabulary() -> None:
    """W1 on the 102,400-token vocabulary: folded (W1's lengths), or re-drawn below
    ``--vocab-hi 102399`` as vLLM's DeepSeek-V2-Lite run was (68,960 output tokens)."""
    from types import SimpleNamespace

    from pagedllm.benchmarks import throughput
    from pagedllm.benchmarks.workloads import totals

    llm = SimpleNamespace(llm_engine=SimpleNamespace(config=SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=102400))))
    p = argparse.ArgumentParser()
    throughput.add_args(p)
    folded = throughput._requests(p.parse_args(["--workload", "W1"]), llm)
    assert totals(folded) == (145873, 69307)
    assert max(max(r.prompt_token_ids) for r in folded) < 102400
    drawn = throughput._requests(p.parse_args(["--workload", "W1", "--vocab-hi", "102399"]),
                                 llm)
    assert totals(drawn) == (145852, 68960)


def test_deepseek_latency(tmp_path: Path) -> None:
    report = _bench(tmp_path, "latency", "--dummy", "deepseek-v2-lite",
                    "--dummy-overrides", json.dumps(TINY_DEEPSEEK), "--input-len", "16",
                    "--output-len", "3", "--num-prompts", "1")
    # Timings are reported, not judged: TPOT is the difference of two separate runs
    # (n tokens minus 1), which a busy machine can make negative.
    assert report["ttft_ms"] > 0 and math.isfinite(report["tpot_ms"])
    assert report["gqa_equivalent"]["kv_heads"] == 4


@pytest.mark.parametrize("repeat", [False, True])
def test_v1_throughput(tmp_path: Path, tiny_vlm: str, repeat: bool) -> None:
    n = 4
    report = _bench(tmp_path, "throughput", "--model", tiny_vlm, "--load-format", "dummy",
                    "--skip-tokenizer-init", "--workload", "V1", "--num-prompts", str(n),
                    "--image-size", "56", "--output-len", "2", "--no-hf",
                    *(["--repeat-image"] if repeat else []))
    row = report["rows"][0]
    assert report["meta"]["workload"] == "V1"
    assert (row["requests"], row["images"], row["output_tokens"]) == (n, n, 2 * n)
    # 56x56 at patch 14, merge 2: 4 image tokens between vision start and end, then
    # 64..256 text tokens.
    assert n * (6 + 64) <= row["prompt_tokens"] <= n * (6 + 256)
    assert row["images_encoded"] + row["encoder_cache_hits"] <= n
    assert 0 < row["encoder_share"] <= 1 and row["encoder_s"] > 0
    assert row["processor_s"] > 0
    if repeat:  # one image for all: encoded once, or found by the later requests
        assert row["images_encoded"] < n
        assert row["encoder_cache_hit_rate"] > 0 or row["cached_prompt_tokens"] > 0
    else:  # every image different: each encoded, no hits
        assert row["images_encoded"] == n and row["encoder_cache_hit_rate"] == 0


def test_v1_latency_reports_the_encoders_part_of_ttft(tmp_path: Path, tiny_vlm: str) -> None:
    report = _bench(tmp_path, "latency", "--model", tiny_vlm, "--load-format", "dummy",
                    "--skip-tokenizer-init", "--workload", "V1", "--num-prompts", "1",
                    "--image-size", "56", "--output-len", "3")
    assert report["workload"] == "V1" and report["output_len"] == 3
    assert 70 <= report["input_len"] <= 262
    assert 0 < report["ttft_encoder_ms"] and 0 < report["ttft_encoder_share"] <= 1
    assert report["ttft_processor_ms"] > 0


def test_text_only_on_the_vlm_and_its_lm_alone(tmp_path: Path, tiny_vlm: str) -> None:
    """Token-id requests without images run on the VLM and on its decoder alone (the
    decoder-only shape with the VLM's text overrides), with the same KV cache.  W1 on
    the GPU takes the same path; ``custom`` keeps this fast on the CPU."""
    args = ["--workload", "custom", "--input-len", "32", "--output-len", "3",
            "--num-prompts", "2", "--batch-sizes", "2", "--no-hf"]
    vlm = _bench(tmp_path, "throughput", "--model", tiny_vlm, "--load-format", "dummy",
                 "--skip-tokenizer-init", *args)
    lm = _bench(tmp_path, "throughput", "--dummy", "qwen2.5-7b", "--dummy-overrides",
                json.dumps(TINY_QWEN_TEXT), *args)
    for r in (vlm["rows"][0], lm["rows"][0]):
        assert (r["requests"], r["prompt_tokens"], r["output_tokens"]) == (2, 64, 6)
        assert "images" not in r
    assert vlm["meta"]["kv_bytes_per_token"] == lm["meta"]["kv_bytes_per_token"]
    assert vlm["meta"]["kv_blocks"] == lm["meta"]["kv_blocks"]
