"""Lockstep between data-parallel engine cores whose experts span every engine.

With ``enable_expert_parallel`` and ``data_parallel_size > 1`` each MoE layer's experts
are spread over the ranks of every engine (``distributed/parallel_state.py``), so a
forward on one engine needs every other engine's ranks inside the same MoE layer's
collectives (``layers/fused_moe/dispatch.py``).  The engine cores therefore agree, once
per loop iteration, on whether anyone has work::

    engine 0:  drain inputs ─► sync(has work?, stopping?) ─► step  (its requests)
    engine 1:  drain inputs ─► sync(has work?, stopping?) ─► step  (no requests: an empty
                                                                    batch, whose ranks run
                                                                    the MoE layers on zero
                                                                    tokens)

Every engine runs the same number of syncs and, after a sync that saw work anywhere,
exactly one model step; so their ranks meet in the same MoE layers in the same order.
An idle engine's empty step costs its ranks one pass over the MoE layers' collectives
(``layers/fused_moe/dispatch.moe_dummy_pass``) and nothing else.  When nobody has work the
engines poll their inputs for ``IDLE_POLL_S`` between syncs, so a request that arrives
at an idle server waits at most that long for the others to join.  A shutdown is agreed
the same way (any engine stopping stops all), so no engine is left waiting in a
collective; an engine that dies instead makes the others' next sync fail at once (gloo
sees its connection close; ``distributed_timeout_seconds`` bounds a hung one), and the
server treats any engine's death as fatal anyway.

The sync is one all-reduce of two integers over a gloo group of the engine-core
processes, built from its own ``TCPStore`` (engine 0 hosts it, on
``data_parallel_rpc_port``): it is not the ranks' world, which may live in other
processes (the ``mp`` executor).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pagedllm.config import ParallelConfig

# How long engines with nothing to do wait for input between syncs.
IDLE_POLL_S = 0.005


class DPLockstep:
    """This engine core's seat in the lockstep group (see the module doc)."""

    idle_poll_s = IDLE_POLL_S

    def __init__(self, parallel: ParallelConfig) -> None:
        self.size = parallel.data_parallel_size
        self.rank = parallel.data_parallel_rank
        timeout = datetime.timedelta(seconds=parallel.distributed_timeout_seconds)
        self._store = dist.TCPStore("127.0.0.1", parallel.data_parallel_rpc_port,
                                    self.size, self.rank == 0, timeout=timeout)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("dp_lockstep", self._store),
                                            self.rank, self.size, timeout)
        self._flags = torch.zeros(2, dtype=torch.int64)
        self.syncs = 0

    def sync(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """``(anyone has work, anyone is stopping)``; blocks until every engine calls it
        (``RuntimeError`` after ``distributed_timeout_seconds`` if one never does)."""
        self._flags[0], self._flags[1] = int(has_work), int(stopping)
        try:
            self._group.allreduce([self._flags]).wait()
        except RuntimeError as e:  # gloo's message names a socket, not an engine
            raise RuntimeError(f"another data-parallel engine left the step lockstep "
                               f"(experts span every engine, so this one cannot go on): "
                               f"{str(e).strip().splitlines()[0][:200]}") from e
        self.syncs += 1
        return bool(self._flags[0]), bool(self._flags[1])
