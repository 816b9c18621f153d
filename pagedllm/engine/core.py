"""EngineCore: the scheduler and the worker, stepped together.

``step()`` = schedule -> execute -> update.  The core sees tokens only (no text): single
sequences, and n-sequence groups sharing a prompt; it runs in the caller's process for the
offline ``LLM`` and in a process of its own behind the API server (``core_proc.py``),
unchanged.
"""

from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.request import Request
from pagedllm.worker.worker import Worker

logger = logging.getLogger("pagedllm")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.worker = Worker(config)
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks)
        self.config = config.with_num_blocks(self.num_blocks)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   self.num_blocks, self.worker.num_cpu_blocks)
        self.max_model_len = config.model_config.max_model_len
        sc = config.scheduler_config
        logger.info("engine ready in %.1f s: max_num_seqs=%d, max_num_batched_tokens=%d, "
                    "policy=%s", time.perf_counter() - t0, sc.max_num_seqs,
                    sc.max_num_batched_tokens, sc.policy)

    @property
    def max_tokens_per_request(self) -> int:
        return self.scheduler.max_tokens_per_request()

    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises ValueError if the request could never fit the KV pool."""
        self.scheduler.add_request(Request.from_engine_core_request(req))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        out = self.worker.execute_model(sched)
        return self.scheduler.update_from_output(sched, out)

    def shutdown(self) -> None:
        self.worker.kv_caches.clear()
