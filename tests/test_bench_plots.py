"""``pagedllm bench throughput | latency --plot``: real runs on the default model (tiny
workloads), the PNG read back with matplotlib.  (``bench serve --plot`` is checked in
tests/server/test_bench_serve.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedllm", "bench", *args,
                           "--max-model-len", "64"], capture_output=True, text=True,
                          timeout=600)


def test_throughput_plot(tmp_path) -> None:
    png, out = tmp_path / "t.png", tmp_path / "t.json"
    r = _bench("throughput", "--workload", "custom", "--input-len", "8", "--output-len", "4",
               "--num-prompts", "2", "--batch-sizes", "1,2", "--repeats", "1", "--no-hf",
               "--plot", str(png), "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["config"] for row in rows] == ["batch 1", "batch 2"]
    # The report names the policy: an offline run's default, FCFS on the CPU.
    assert report["meta"]["scheduling_policy"] == "fcfs"
    assert "fcfs policy" in r.stdout
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 200 and image.std() > 0


def test_latency_plot(tmp_path) -> None:
    png = tmp_path / "l.png"
    r = _bench("latency", "--input-len", "8", "--output-len", "4", "--num-prompts", "2",
               "--plot", str(png))
    assert r.returncode == 0, r.stderr
    image = matplotlib.image.imread(png)
    assert image.shape[1] > 500 and image.std() > 0


def test_plot_to_an_unwritable_path_is_one_line(tmp_path) -> None:
    r = _bench("latency", "--input-len", "8", "--output-len", "2", "--num-prompts", "1",
               "--plot", str(tmp_path / "no" / "such" / "dir.png"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: plot: cannot write")
    assert "loaded" not in r.stderr  # refused before the model was loaded
