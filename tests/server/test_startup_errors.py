"""Start-up refusals are one line naming the flag and what works (issue 28): float16 on
the CPU, a KV cache too small for one request, a KV cache larger than memory, and an
out-of-memory error during a start-up phase."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.worker.startup_memory import StartupMemoryError, out_of_memory_hint

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusals")


def _serve_fails(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port",
                        "0", *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr, time.monotonic() - t0


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1, err  # said once, not once per process
    assert err.strip().splitlines()[-1] == errors[0]
    return errors[0]


@pytest.mark.parametrize("dtype", ["float16", "half"])
def test_float16_on_cpu_refused_by_the_python_api(dtype: str) -> None:
    with pytest.raises(ValueError, match=r"dtype: .*not supported on the CPU.*bfloat16"):
        LLM(dtype=dtype)
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype=dtype, device="cpu").create_engine_config()


def test_float16_on_cpu_refused_by_serve_at_once() -> None:
    rc, err, took = _serve_fails("--dtype", "float16")
    line = _one_line_error(err)
    assert rc == 1
    assert line.startswith("error: dtype") and "--dtype" in line and "float32" in line
    assert "engine core" not in err  # refused before the engine core was spawned
    assert took < 60, took


def test_kv_cache_larger_than_memory_one_line() -> None:
    """An absurd KV size (1 PB) is refused before any allocation, naming the flags."""
    rc, err, _ = _serve_fails("--max-model-len", "256", "--kv-cache-memory-bytes",
                              str(10**15))
    line = _one_line_error(err)
    assert rc == 1 and line.startswith("error:") and "does not fit" in line
    assert f"lower --kv-cache-memory-bytes ({10**15}) to at most" in line


def test_out_of_memory_in_a_startup_phase_names_the_flags() -> None:
    """A real allocator failure (more than the address space) inside a phase."""
    config = EngineArgs(max_model_len=256, device="cpu").create_engine_config()
    with pytest.raises(StartupMemoryError) as kv, out_of_memory_hint("kv", config):
        torch.empty(1 << 60, dtype=torch.uint8)
    msg = str(kv.value)
    assert "\n" not in msg and "--gpu-memory-utilization" in msg
    assert "--max-model-len (256)" in msg and "--max-num-seqs" in msg
    with pytest.raises(StartupMemoryError, match="weights do not fit"), \
            out_of_memory_hint("model", config):
        torch.empty(1 << 60, dtype=torch.uint8)
    with pytest.raises(KeyError), out_of_memory_hint("kv", config):  # others pass through
        raise KeyError("x")


def test_broken_xgrammar_after_engine_start_exits_with_one_line(tmp_path) -> None:
    """A failure after the engine core is up (here: the tools' prompt fallback meets an
    xgrammar whose own import fails, as a half-installed wheel does) is one line naming
    the fix, and the server exits: the engine core is shut down, not left running with
    the API process waiting on it (it hung until killed, 2026-12-05)."""
    pkg = tmp_path / "xgrammar"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from tvm_ffi_absent_for_this_test import x  # noqa\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port",
                        "0", "--skip-tokenizer-init", "--max-model-len", "256"],
                       capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}"
                            f"{os.environ.get('PYTHONPATH', '')}"})
    line = _one_line_error(p.stderr)
    assert p.returncode == 1
    assert "xgrammar" in line and "--tool-call-parser none" in line, line
    assert "tvm_ffi_absent_for_this_test" in line
    assert time.monotonic() - t0 < 200
