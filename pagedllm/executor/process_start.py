"""Starting the engine's processes from any script, guarded by ``if __name__ ==
"__main__":`` or not.

Ranks and the engine core start with ``forkserver`` or ``spawn`` (never a plain fork of
the caller, whose ZeroMQ context, OpenMP pool, threads or CUDA context the child would
inherit half-alive).  Both start methods hand the child the path (or module name) of the
caller's ``__main__``, and the child imports it before it unpickles its target -- so a
plain script ``llm = LLM(model=..., tensor_parallel_size=2)`` without the guard runs its
own top level again in every child, which then tries to start processes itself and dies
with multiprocessing's "bootstrapping phase" ``RuntimeError``.

pagedllm's process targets and arguments (``run_worker``, ``run_engine_core``, the
engine config) never live in ``__main__``, so the child has no reason to import it:
:func:`start_process` hides the main module from multiprocessing while it starts a child
whose pickled arguments do not name ``__main__``, and the script runs once, guarded or
not (vLLM instead forks where that is safe and otherwise asks for the guard).  When they
do name it (an object the script defined, passed in the engine arguments), the child
must import the script; if that script is unguarded, :func:`check_not_bootstrapping`
replaces the multiprocessing traceback with one line naming the fix.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import random
import socket
import sys
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

UNGUARDED_MAIN = (
    "pagedllm: this script starts an engine while a worker process imports it; put the "
    "code that creates the LLM (or engine) under `if __name__ == \"__main__\":`")


def check_not_bootstrapping() -> None:
    """Raise ``RuntimeError(UNGUARDED_MAIN)`` when called while this process is a child
    importing its parent's ``__main__`` (an unguarded script about to start processes
    from its top level), before multiprocessing raises its own long error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(UNGUARDED_MAIN)


def _names_main(args: tuple[Any, ...]) -> bool:
    """Whether pickling ``args`` refers to the ``__main__`` module (a class or function
    the script defined): the child then needs the script imported to unpickle them."""
    try:
        return b"__main__" in pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # unpicklable here: let multiprocessing report it as it would
        return True


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While active, multiprocessing's preparation data names no main module
    (``spawn.get_preparation_data`` reads ``__main__.__spec__`` and ``__file__``)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            main.__dict__.pop("__spec__", None)


def start_process(ctx: multiprocessing.context.BaseContext, target: Any,
                  args: tuple[Any, ...], name: str, daemon: bool | None = None,
                  ) -> BaseProcess:
    """Start ``target(*args)`` in a new process of ``ctx`` (spawn or forkserver) without
    re-running the caller's script in it (module doc); returns the started process."""
    check_not_bootstrapping()
    proc = ctx.Process(target=target, args=args, name=name, daemon=daemon)  # type: ignore[attr-defined]
    if _names_main((target, args)):
        proc.start()
    else:
        with _main_hidden():
            proc.start()
    return proc


# Ports below the kernel's ephemeral range that ``free_port`` picks from.
_PORT_FLOOR = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's range for ``bind(0)`` and ``connect`` (Linux's
    default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now, which the rendezvous binds a moment later.

    The port is taken below the kernel's ephemeral range when there is room: a port
    from ``bind(0)`` goes back into that range as soon as it is released, and in the
    seconds before the rendezvous binds it any socket the kernel numbers itself (gloo's
    pair connections of an earlier world, an HTTP client) may be handed it, which then
    fails the rendezvous with ``EADDRINUSE``.  Outside the range only an explicit bind
    can take it."""
    lo = _ephemeral_low()
    rng = random.Random()
    if lo - _PORT_FLOOR >= 1000:
        for _ in range(64):
            port = rng.randrange(_PORT_FLOOR, lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
