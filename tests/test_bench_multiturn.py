"""``pagedllm bench multiturn`` (issue 45's W6) end to end on the CPU at tiny sizes, on the
default model: both modes run, the host tier serves prompt tokens that the device pool
alone loses, and the policy is the server's (fcfs).  Counts are checked, never a time."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import main


def test_multiturn_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "w6.json"
    # A device pool of ~1.5 conversations' histories for 5 conversations, round-robin.
    assert main(["bench", "multiturn", "--num-conversations", "5", "--turns", "3",
                 "--history-len", "96", "--turn-min", "16", "--turn-max", "32",
                 "--output-len", "2", "--max-concurrency", "2",
                 "--kv-cache-memory-bytes", "15000000", "--kv-offload-size", "0.05",
                 "--max-model-len", "256", "--quantization", "none",
                 "--output-json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    off, on = modes["off"], modes["on"]
    for m in (off, on):
        assert m["turns"] == 15 and m["output_tokens"] == 30
        assert m["scheduling_policy"] == "fcfs"
    assert off["prompt_tokens"] == on["prompt_tokens"]  # same conversations, same seed
    assert off["cached_tokens"] == 0 and "host_blocks" not in off
    assert on["cached_tokens"] > 0 and on["host_hit_blocks"] > 0
