"""Test-only hooks for servers that the tests start (``harness.hooks_env`` installs them).

A server started with this directory on ``PYTHONPATH`` imports this module at interpreter
start-up, in the API-server process and in every engine-core process it spawns (they
inherit the environment).  Nothing here is part of pagedllm: the product has no test hooks.
Each hook patches one pagedllm module right after it is imported, and only when its
variable is set:

- ``PAGEDLLM_TEST_STEP_PACE_S=S``: every ``EngineCore.step()`` first sleeps ``S`` seconds.
  A request of ``max_tokens`` N then lasts at least ``N * S`` seconds however fast the
  machine decodes, so a test that must act while a request is still running (disconnect,
  cancel, SIGTERM, kill) holds by construction instead of racing the model's speed.
- ``PAGEDLLM_TEST_FAIL_AFTER_STEPS=N``: the (N+1)-th ``EngineCore.step()`` raises (the
  "model forward raises" fault of RELIABILITY.md).
- ``PAGEDLLM_TEST_LEAK_BYTES_PER_S=N``: from the first ``/v1/`` request on, a thread in
  the API server keeps N more bytes, touched, every second, forever (capped at 2 GiB). The
  leak grows with wall time, not with requests served, so the soak's leak detector sees
  the same growth over its window on a quiet machine and on a loaded one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

PACE_ENV = "PAGEDLLM_TEST_STEP_PACE_S"
FAIL_ENV = "PAGEDLLM_TEST_FAIL_AFTER_STEPS"
LEAK_ENV = "PAGEDLLM_TEST_LEAK_BYTES_PER_S"
LEAK_CAP = 2 << 30
LEAK_TICK_S = 0.25


def _patch_engine_core(module: ModuleType) -> None:
    pace = float(os.environ.get(PACE_ENV) or 0)
    fail = os.environ.get(FAIL_ENV)
    fail_after = int(fail) if fail else None
    original = module.EngineCore.step
    steps = [0]

    def step(self: Any) -> Any:
        if fail_after is not None and steps[0] >= fail_after:
            raise RuntimeError(f"injected fault after {steps[0]} steps ({FAIL_ENV})")
        steps[0] += 1
        if pace > 0:
            time.sleep(pace)
        return original(self)

    module.EngineCore.step = step


def _leak_forever(bytes_per_s: int) -> None:
    leaked: list[bytes] = []
    per_tick = int(bytes_per_s * LEAK_TICK_S)
    while len(leaked) * per_tick < LEAK_CAP:
        leaked.append(b"x" * per_tick)  # written, so the pages are resident
        time.sleep(LEAK_TICK_S)
    threading.Event().wait()  # keeps ``leaked`` alive for the life of the process


def _patch_api_server(module: ModuleType) -> None:
    rate = int(os.environ.get(LEAK_ENV) or 0)
    original = module.build_app
    started = threading.Event()

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)

        async def leaking(scope: Any, receive: Any, send: Any) -> None:
            if (rate and scope["type"] == "http" and scope["path"].startswith("/v1/")
                    and not started.is_set()):
                started.set()
                threading.Thread(target=_leak_forever, args=(rate,), daemon=True,
                                 name="test-leak").start()
            await app(scope, receive, send)

        return leaking

    module.build_app = build_app


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self.loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a patched module with the other finders and wraps its loader."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _install() -> None:
    patches: dict[str, Callable[[ModuleType], None]] = {}
    if os.environ.get(PACE_ENV) or os.environ.get(FAIL_ENV):
        patches["pagedllm.engine.core"] = _patch_engine_core
    if int(os.environ.get(LEAK_ENV) or 0) > 0:
        patches["pagedllm.entrypoints.openai.api_server"] = _patch_api_server
    if patches:
        sys.meta_path.insert(0, _PatchOnImport(patches))


_install()
