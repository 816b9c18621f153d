"""``pagedllm bench matrix`` on the CPU (issue 43): two shrunk rows through real child
processes, and an unknown row refused before anything runs.  Only the report's fields
are checked, never a time's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedllm.benchmarks.matrix import Row, format_table, parse_rows
from pagedllm.benchmarks.workloads import DUMMY_CONFIGS
from pagedllm.entrypoints.cli import main

ROW = "smollm2-135m-w4a16-asym"  # one row: each run is a child process (~10 s on CI)


def test_a_tiny_row_reports_w1_and_w4(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    rc = main(["bench", "matrix", "--rows", ROW, "--device", "cpu",
               "--dummy-overrides", '{"num_hidden_layers": 2}', "--w1-num-prompts", "2",
               "--w4-input-len", "32", "--w4-output-len", "8", "--w4-num-prompts", "1",
               "--row-timeout", "120", "--log-dir", str(tmp_path / "logs"),
               "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, [r["status"] for r in report["rows"]]
    (r,) = report["rows"]
    assert r["row"] == ROW and r["ok"] and r["status"] == "ok"
    assert r["w1_out_tok_s"] > 0 and r["w4_tpot_ms"] > 0 and r["w4_ttft_ms"] > 0
    assert r["device"] == "cpu"
    assert "--dummy-overrides" in r["runs"]["W1"]["command"]
    assert r["runs"]["W4"]["report"]["quantization"] == "compressed-tensors"
    # Parsed from the child's start-up log line: the int4 weights of the 2-layer shape
    # (tied 49152 x 576 embedding kept in fp32) are under its fp32 size.
    cfg = DUMMY_CONFIGS["smollm2-135m"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    fp32 = 4 * (cfg["vocab_size"] * h + 2 * (h * (2 * h + 2 * kv) + 3 * h * i))
    assert 0 < r["weight_gib"] * 2 ** 30 < fp32


def test_unknown_row_exits_naming_rows_before_running() -> None:
    res = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "matrix", "--rows",
                          "smollm2-135m,no-such-model"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert "--rows" in res.stderr and "no-such-model" in res.stderr
    assert "child logs" not in res.stdout  # nothing ran


def test_rows_take_a_quantization_suffix() -> None:
    assert parse_rows("llama3-8b, llama3-8b+fp8") == [
        Row("llama3-8b", "llama3-8b"), Row("llama3-8b+fp8", "llama3-8b", "fp8")]
    phi = DUMMY_CONFIGS["phi-4-14b"]
    assert (phi["hidden_size"], phi["intermediate_size"], phi["num_hidden_layers"],
            phi["num_attention_heads"], phi["num_key_value_heads"], phi["vocab_size"]) \
        == (5120, 17920, 40, 40, 10, 100352)


def test_failed_row_shows_its_reason_in_the_table() -> None:
    row = {"row": "mixtral-8x7b", "w1_out_tok_s": None, "w4_tpot_ms": 6.9,
           "w4_ttft_ms": 40.3, "weight_gib": 87.0, "status": "W1: timed out after 600 s"}
    text = format_table([row])
    assert "W1: timed out after 600 s" in text and " - " in text
    assert format_table([row], markdown=True).splitlines()[2].startswith("| mixtral-8x7b |")
