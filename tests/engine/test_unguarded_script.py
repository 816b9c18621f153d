"""A plain script without ``if __name__ == "__main__":`` starts the engine's processes
(issue 46 item 19): the tensor-parallel ranks (forkserver) and the engine core of
``AsyncLLM`` (spawn) no longer re-run the script's top level, so the script runs once
and prints its output instead of dying with multiprocessing's "bootstrapping phase"
``RuntimeError``.  The one-line message for the case that still needs the guard is
checked directly."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.executor.process_start import UNGUARDED_MAIN, check_not_bootstrapping

ROOT = Path(__file__).resolve().parents[2]

TP_SCRIPT = """
from pagedllm import LLM, SamplingParams
print("top level ran", flush=True)
llm = LLM(tensor_parallel_size=2, distributed_executor_backend="mp", max_model_len=64,
          max_num_batched_tokens=64, enable_prefix_caching=False)
out = llm.generate(["The capital of France is"],
                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("TOKENS", out[0].outputs[0].token_ids, flush=True)
llm.shutdown()
"""

ASYNC_SCRIPT = """
import asyncio
from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
print("top level ran", flush=True)

async def go():
    llm = await AsyncLLM.create(EngineArgs(max_model_len=64))
    tokens = []
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async for out in llm.generate("The capital of France is", params, "r0"):
        tokens += out.outputs[0].token_ids  # streams carry deltas
    print("TOKENS", list(tokens), flush=True)
    await llm.shutdown()

asyncio.run(go())
"""


def _run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("source", [TP_SCRIPT, ASYNC_SCRIPT], ids=["tp2", "async_core"])
def test_unguarded_script_runs_once(tmp_path: Path, source: str) -> None:
    p = _run_script(tmp_path, source)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "bootstrapping phase" not in text
    # The script's top level ran in this process only, not again in a child.
    assert p.stdout.count("top level ran") == 1, text
    tokens = [line for line in p.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 1 and len(eval(tokens[0][len("TOKENS"):])) == 4, text


def test_bootstrapping_child_gets_one_line() -> None:
    """In a child still importing its parent's script, starting an engine raises the
    one-line reason that names the guard."""
    me = multiprocessing.current_process()
    me._inheriting = True  # type: ignore[attr-defined]  (what multiprocessing sets)
    try:
        with pytest.raises(RuntimeError) as e:
            check_not_bootstrapping()
    finally:
        del me._inheriting  # type: ignore[attr-defined]
    assert str(e.value) == UNGUARDED_MAIN and "\n" not in UNGUARDED_MAIN
    assert 'if __name__ == "__main__":' in UNGUARDED_MAIN
    check_not_bootstrapping()  # not bootstrapping: no error
