"""``pagedllm models`` prints the registry's table (every architecture and its tasks);
``pagedllm bench embed`` runs end to end on a tiny checkpoint and writes its JSON; a
bad value is one line and exit status 1."""

from __future__ import annotations

import json

from pagedllm.entrypoints.cli import main
from pagedllm.models.registry import ARCHITECTURES, architectures_table
from tests.pooling.tiny_encoders import build_encoder


def test_models_lists_every_architecture(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == architectures_table()
    assert all(f"`{a}`" in out for a in ARCHITECTURES)
    assert "| `BertModel` |" in out and "embed" in out and "classify, score" in out


def test_bench_embed_runs(tmp_path, capsys) -> None:
    path = str(tmp_path / "bert")
    build_encoder("bert", path)
    result = str(tmp_path / "r.json")
    assert main(["bench", "embed", "--model", path, "--input-len", "8", "--batch-size", "2",
                 "--num-prompts", "4", "--num-iters", "1", "--device", "cpu",
                 "--output-json", result]) == 0
    r = json.load(open(result))
    assert r["num_prompts"] == 4 and r["dimension"] == 64 and r["embeddings_per_s"] > 0
    assert main(["bench", "embed", "--model", path, "--batch-size", "0"]) == 1
    assert "batch_size must be >= 1" in capsys.readouterr().err
