"""A real ``pagedllm serve`` subprocess on loopback, and helpers to talk to it.

(Fixtures are in ``conftest.py``.)

Servers cost several seconds to start (two interpreters, model load), so the default one
is shared by the whole session (``server`` fixture); tests that need special flags or that
kill/stop the server start their own with ``ServerProcess``.  Each server binds port 0
and the URL is read back from its log, so parallel runs never collide.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import psutil

HOOKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_hooks")

# Seconds per engine step on a paced server: a 200-token request lasts at least 10 s,
# far longer than any test waits before it disconnects, cancels, signals or kills.
PACE_S = 0.05


def hooks_env(*, step_pace_s: float = 0.0, fail_after_steps: int | None = None,
               leak_bytes_per_s: int = 0) -> dict[str, str]:
    """The environment that installs ``engine_hooks/sitecustomize.py``'s test hooks in a
    server (its API process and engine cores); pass it as ``running_server(env=...)``."""
    env = {"PYTHONPATH": os.pathsep.join(
        p for p in (HOOKS_DIR, os.environ.get("PYTHONPATH", "")) if p)}
    if step_pace_s:
        env["PAGEDLLM_TEST_STEP_PACE_S"] = str(step_pace_s)
    if fail_after_steps is not None:
        env["PAGEDLLM_TEST_FAIL_AFTER_STEPS"] = str(fail_after_steps)
    if leak_bytes_per_s:
        env["PAGEDLLM_TEST_LEAK_BYTES_PER_S"] = str(leak_bytes_per_s)
    return env


# Small context and batch: start-up and every request stay cheap on a 2-core CPU.
BASE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "8"]
START_TIMEOUT = 240.0


class ServerProcess:
    """``python -m pagedllm.entrypoints.cli serve --port 0 ...`` with its log in a file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 base_args: list[str] | None = None) -> None:
        self.logfile = tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log",
                                                   delete=False)
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host",
               "127.0.0.1", "--port", "0", *(BASE_ARGS if base_args is None else base_args),
               *args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.logfile, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)
        self.url = ""

    # ------------------------------------------------------------------ lifecycle

    def log(self) -> str:
        with open(self.logfile.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            m = re.search(r"Serving on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_pid(self) -> int:
        m = re.search(r"engine core pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """Kill the server and anything it started (its own session/process group)."""
        kids = self.descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for k in kids:
            with contextlib.suppress(psutil.NoSuchProcess):
                k.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stop(signal.SIGTERM, timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.logfile.close()
        with contextlib.suppress(OSError):
            os.unlink(self.logfile.name)

    # ------------------------------------------------------------------ helpers

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120.0), **kw)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series (name + labels minus model_name and engine, except on
        the per-engine DP gauges): value}."""
        text = httpx.get(self.url + "/metrics", timeout=30,
                         headers=getattr(self, "auth_headers", None)).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, _, value = line.rpartition(" ")
            # The data-parallel per-engine gauges keep their engine label.
            labels = "model_name" if key.split("{")[0] in _PER_ENGINE else "model_name|engine"
            key = re.sub(rf',?({labels})="[^"]*"', "", key).replace("{,", "{")
            key = key.replace("{}", "")
            out[key] = float(value)
        return out


_PER_ENGINE = {f"pagedllm:engine_{n}" for n in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "requests_assigned",
    "requests_prefix_routed")}


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None,
                   base_args: list[str] | None = None) -> Iterator[ServerProcess]:
    s = ServerProcess(*args, env=env, base_args=base_args)
    try:
        yield s.wait_ready()
    finally:
        s.close()


def wait_until(pred, timeout: float = 30.0, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def kv_idle(s: ServerProcess) -> bool:
    m = s.metrics()
    return (m.get("vllm:num_requests_running") == 0
            and m.get("vllm:num_requests_waiting") == 0
            and m.get("vllm:kv_cache_usage_perc") == 0
            and m.get("pagedllm:kv_cache_free_blocks") == m.get(
                "pagedllm:kv_cache_total_blocks"))
