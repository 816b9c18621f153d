"""How a frontend talks to the engine core, wherever the core runs.

The offline ``LLM`` uses ``InprocClient`` (the core in the same process; ``get_output``
runs one step).  The API server uses the ZeroMQ client in ``mp_client.py`` with the core
in its own process.  Both speak the msgspec messages of ``messages.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """Contract: a request is one sequence or an n-sequence group (``fork_ids``);
    ``get_output`` returns the outputs of the next step (possibly empty); aborting an
    unknown or finished id is a no-op."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def max_tokens_per_request(self) -> int:
        """The most tokens (prompt + output) one request can ever hold in the KV pool."""


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.engine.core import EngineCore

        self.core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()

    @property
    def max_tokens_per_request(self) -> int:
        return self.core.max_tokens_per_request
