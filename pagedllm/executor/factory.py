"""Which executor a config asks for (``ParallelConfig.distributed_executor_backend``).

Above the backends (``uniproc.py``, ``multiproc.py``, ``ray_executor.py``) and their base
(``base.py``), so the base never imports a subclass; each backend is imported only when
chosen (Ray, for one, is optional).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor of ``config.parallel_config.distributed_executor_backend``."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend must be uni, mp or ray, got {backend!r}")
