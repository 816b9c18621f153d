"""Per-step timing trace of the engine core, for finding where latency tails come from.

Set ``PAGEDLLM_STEP_TRACE=/path/file.jsonl`` and every ``EngineCore.step()`` appends one
JSON line::

    {"t": wall time the step began (time.time(), comparable with a client's send times),
     "sched_ms": scheduling, "launch_ms": building inputs and launching the forward,
     "wait_ms": waiting for the previous step's tokens (the device's time shows here),
     "update_ms": updating requests from them,
     "tokens": tokens scheduled, "reqs": requests scheduled,
     "chunks": the token counts of requests scheduled more than one token (prompt
     chunks; a whole prompt's chunk equals its length)}

Without async scheduling "launch_ms" includes the device time and "wait_ms" is 0.
Off (the default) it costs one attribute test per step; on, one line write (a syscall:
the file is line-buffered, so a killed core loses nothing).  ``benchmarks/w2_suite.sh``
sets it for W2.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import IO, Any

import pagedllm.envs as envs
from pagedllm.core.outputs import SchedulerOutput

TRACE_ENV = "PAGEDLLM_STEP_TRACE"  # read through envs.step_trace_path()


class StepTrace:
    """Appends one line per step to the file named by ``PAGEDLLM_STEP_TRACE``."""

    def __init__(self, path: str) -> None:
        self.file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = envs.step_trace_path()
        return cls(path) if path else None

    def record(self, sched: SchedulerOutput, t_wall: float, t0: float, t1: float,
               t2: float, t3: float, t4: float) -> None:
        """``t0``..``t4`` (perf_counter): schedule start, launch start, wait start,
        update start, end."""
        n = sched.num_scheduled_tokens
        self.file.write(json.dumps({
            "t": round(t_wall, 6), "sched_ms": round((t1 - t0) * 1e3, 3),
            "launch_ms": round((t2 - t1) * 1e3, 3), "wait_ms": round((t3 - t2) * 1e3, 3),
            "update_ms": round((t4 - t3) * 1e3, 3),
            "tokens": sched.total_num_scheduled_tokens, "reqs": len(n),
            "chunks": [k for k in n.values() if k > 1]}) + "\n")

    def close(self) -> None:
        self.file.close()


class TraceFile:
    """For a tool that reads the trace of an engine it builds next: the file named by
    ``PAGEDLLM_STEP_TRACE`` if the caller set one, else a temporary file that this sets
    the variable to (so the engine core built next writes it) and :meth:`close` deletes."""

    def __init__(self, prefix: str = "step-trace-") -> None:
        path = envs.step_trace_path()
        self.owned = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
            os.close(fd)
            os.environ[TRACE_ENV] = path
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        """Every line written so far, parsed."""
        with open(self.path) as f:
            return [json.loads(line) for line in f]

    def close(self) -> None:
        """Unset the variable and delete the file, if this made it."""
        if self.owned:
            os.environ.pop(TRACE_ENV, None)
            os.unlink(self.path)
