"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the
kernel before it in the stream is still finishing.

A batch-1 decode step is ~290 short kernels back to back (3-60 µs each).  Without PDL
each one starts only after its predecessor has fully drained, so every boundary costs the
predecessor's tail (its last programs running on a few SMs) plus the new kernel's
launch and ramp-up.  With PDL the next kernel is launched as soon as every program of
the current one has executed ``gdc_launch_dependents``; its programs then sit in
``gdc_wait`` until the predecessor has completed and its writes are visible.  Work placed
before the wait overlaps the predecessor's tail: the GEMV (``kernels/gemv.py``) fetches
its first weight tile there.

**Contract** for a kernel compiled with ``USE_PDL``: it calls :func:`pdl_wait` (or
``gdc_wait`` directly) before any load of data that another kernel writes (activations,
KV cache, sampled tokens) and before any store.  Before the wait it may read only

* weights, which no kernel writes after loading (``Worker.load_model`` synchronises
  after loading), and
* the step's attention metadata and positions (``positions``, ``slot_mapping``,
  ``seq_lens``, ``block_tables``, ``query_start_loc``), which only host-to-device copies
  write, before the step's forward.  The forward's first kernel is an ordinary launch
  (the embedding gather), so it starts after those copies have finished, and every PDL
  kernel after it launches after it started -- hence after the copies too.  (The
  async-scheduling fix-up writes only ``input_ids``, which no PDL kernel reads.)

At batch 1 a kernel's time is mostly its chain of dependent memory round trips, so
taking these reads off the chain (they overlap the predecessor's tail) is most of what
PDL can save after the launch gaps.
Completion is transitive: every PDL kernel waits for its predecessor to *complete*, and
that predecessor could not complete before its own wait returned, so once a kernel is past
its wait every earlier kernel in the stream has finished.  Kernels without PDL (cuBLAS,
torch ops) keep ordinary stream order, and mixing the two is safe in both directions.

**Where a kernel triggers** is measured per kernel, not assumed.  A trigger at the start
lets the next kernel launch at once; its programs then wait resident on the SMs for as long
as this kernel runs.  For the bf16 GEMV that pays (Llama-3-8B W4 TPOT 5.41 ms against 5.48
with the trigger after its stores; H100, 2026-12-06).  The int4 GEMVs (``wna16_stripe``,
``wna16_kmajor``), whose programs are many and register-light, lost to it: they trigger
after their last load (W4 TPOT with zero points 6.50 -> 4.17 ms, symmetric 3.57 -> 3.33;
PDL off entirely: 4.29 and 3.41).  ``tests/kernels/sm90_compile.pdl_trigger_follows_loads``
holds them there.  No explicit trigger anywhere (each program's exit triggers) lost on
every shape tried (W4 TPOT Llama-3-8B 5.73 against 5.56 ms, Gemma-3-12B 9.45 against
9.34, Qwen3-30B-A3B 3.56 against 3.26; H100, one lease).

CUDA graphs keep the dependency (stream capture records a programmatic edge), so the
overlap also happens on replay.  PDL is off in the Triton interpreter and below compute
capability 9.0 (tests/kernels/test_pdl.py compares both by patching ``_capability_ok``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def sm90_or_newer(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.0 or more (cached per
    device: cheap enough for every launch)."""
    return device.type == "cuda" and _capability_ok(
        device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL (read per launch, so the
    interpreter switch takes effect without a restart)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return sm90_or_newer(device)


def pdl_launch_args(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a ``kernel[grid](...)`` call of a kernel that takes a
    ``USE_PDL`` constexpr: the constexpr and, when on, the launch attribute."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream launch (once every program got here)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Trigger then wait: the prologue of a kernel that reads nothing before the wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
