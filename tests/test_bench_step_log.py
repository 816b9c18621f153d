"""``pagedllm bench throughput --step-log``: a real run on the default model whose logged
steps account for every token it computed, and the summary's bucketing."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.benchmarks.step_log import summarise


def test_step_log_accounts_for_every_computed_token(tmp_path) -> None:
    log, out = tmp_path / "steps.json", tmp_path / "t.json"
    # 48-token budget over 6 prompts of 40: chunked prefill, so mixed and decode steps
    r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "throughput",
                        "--workload", "custom", "--input-len", "40", "--output-len", "5",
                        "--num-prompts", "6", "--batch-sizes", "6", "--repeats", "2",
                        "--no-hf", "--max-model-len", "64", "--max-num-batched-tokens", "48",
                        "--step-log", str(log), "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["rows"][0]
    report = json.loads(log.read_text())
    assert len(report["runs"]) == 2
    # every prompt token once, every output token but the first (the prefill's sample)
    computed = row["prompt_tokens"] + row["output_tokens"] - row["requests"]
    for run, secs in zip(report["runs"], row["pagedllm_runs_s"]):
        assert sum(tokens for _, tokens, _ in run) == computed
        assert all(0 < reqs <= tokens <= 48 for _, tokens, reqs in run)
        assert 0.5 * secs < sum(dt for dt, _, _ in run) <= secs + 1e-3
    rows = report["summary"]
    assert sum(s["steps"] for s in rows) == len(report["runs"][-1])
    assert {s["kind"] for s in rows} == {"decode", "mixed"}
    for s in rows:
        assert (s["mean_tokens"] == s["mean_reqs"]) == (s["kind"] == "decode")
    assert abs(sum(s["share"] for s in rows) - 1.0) < 1e-9
    assert "median ms" in r.stdout and "steps of the last timed run" in r.stdout


def test_summary_buckets_steps_as_the_runner_pads_them() -> None:
    steps = [(0.010, 5, 5), (0.012, 7, 7), (0.030, 300, 40), (0.050, 320, 41),
             (0.200, 5000, 8)]
    rows = summarise(steps, [1, 2, 4, 8, 16], [256, 320, 512], {("mixed", 320): 20.0})
    got = [(r["kind"], r["size"], r["steps"]) for r in rows]
    assert got == [("decode", 8, 2), ("mixed", 320, 2), ("mixed", "eager", 1)]
    assert rows[1]["replay_ms"] == 20.0 and rows[0]["replay_ms"] is None
    assert abs(rows[1]["seconds"] - 0.080) < 1e-12 and abs(rows[1]["median_ms"] - 40.0) < 1e-9
    assert abs(rows[1]["share"] - 0.080 / 0.302) < 1e-12
