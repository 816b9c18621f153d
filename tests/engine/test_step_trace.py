"""PAGEDLLM_STEP_TRACE: one JSON line per engine step, in both scheduling modes."""

from __future__ import annotations

import json
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.step_trace import TRACE_ENV

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_trace_has_a_line_per_step(tmp_path, monkeypatch, async_scheduling: bool) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    llm = LLM(str(tmp_path / "model"), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=128, max_num_batched_tokens=16, device="cpu",
              async_scheduling=async_scheduling)
    t0 = time.time()
    prompts = [[5 + i for i in range(20)], [7, 8, 9]]  # 20 tokens: two chunks of <= 16
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert lines, "no step traced"
    assert all(t0 <= x["t"] <= time.time() for x in lines)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    assert all(x["tokens"] <= 16 and x["reqs"] <= 2 for x in lines)
    assert all(x[k] >= 0 for x in lines for k in ("sched_ms", "launch_ms", "wait_ms",
                                                  "update_ms"))
    # FCFS with a 16-token budget: the long prompt's first chunk fills step 1; its last
    # 4 tokens and the short prompt share step 2; then decodes only.
    assert lines[0]["chunks"] == [16] and lines[0]["reqs"] == 1
    assert sorted(lines[1]["chunks"]) == [3, 4]
    assert all(x["chunks"] == [] for x in lines[2:])
