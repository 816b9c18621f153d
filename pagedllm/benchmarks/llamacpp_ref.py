"""Optional llama.cpp reference for ``bench throughput`` (batch 1, the same GGUF file).

llama-cpp-python is not a dependency: ``--llama-cpp-python PYTHON`` names an interpreter
that has it (for example a throw-away venv), and the timing runs there in a subprocess
(its own process, so it never shares a thread pool with torch).  Without it the column is
skipped with a note.  Each request is timed like ours: prompt evaluation plus
``output_len`` greedy tokens (argmax of the logits, EOS ignored), one sequence at a time
(llama-cpp-python's ``Llama`` runs a single sequence), ``n_threads`` threads.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_threads=a["threads"], n_threads_batch=a["threads"],
            n_ctx=a["n_ctx"], verbose=False)
def run(prompt, n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return time.perf_counter() - t0
run(a["prompts"][0], 8)  # warm-up
runs = []
for _ in range(a["repeats"]):
    runs.append(sum(run(p, a["output_len"]) for p in a["prompts"]))
import llama_cpp
print(json.dumps({"runs_s": runs, "version": llama_cpp.__version__}))
"""


def llamacpp_batch1(python: str, gguf_path: str, prompts: list[list[int]], output_len: int,
                    threads: int, repeats: int) -> dict[str, Any]:
    """``{"out_tok_s", "runs_s", "version"}`` (median of ``repeats`` runs over the
    prompts, one after another), or ``{"skipped": reason}``."""
    args = {"gguf": gguf_path, "prompts": prompts, "output_len": output_len,
            "threads": threads, "repeats": max(1, repeats),
            "n_ctx": max(len(p) for p in prompts) + output_len + 16}
    try:
        proc = subprocess.run([python, "-c", _SCRIPT, json.dumps(args)], capture_output=True,
                              text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as e:
        return {"skipped": f"llama.cpp reference not run: {e}"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"llama.cpp reference failed ({python}): {tail}"}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = sorted(res["runs_s"])
    med = runs[len(runs) // 2]
    return {"out_tok_s": output_len * len(prompts) / med, "runs_s": res["runs_s"],
            "version": res["version"]}
