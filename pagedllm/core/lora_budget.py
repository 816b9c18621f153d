"""At most ``max_loras`` distinct LoRA adapters among the running requests (torch-free).

The runner keeps ``max_loras`` adapters on the device; every step's adapters must fit.
Counting the adapters of *all* running requests (not just those scheduled this step)
keeps the bound whatever subset a later step schedules.  A waiting request whose adapter
would be one too many is skipped this step (others behind it may run); it keeps its
place in the queue.  With ``max_loras`` 0 (LoRA off) the budget admits every request and
counts nothing, so the scheduler asks it unconditionally.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.request import Request


class LoRABudget:
    """One step's adapter count: the adapters of ``running``, then of each admitted
    request (``add``)."""

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.ids = {r.lora_request.lora_int_id for r in running
                    if r.lora_request is not None} if max_loras else set()

    def admits(self, req: Request) -> bool:
        """Whether ``req``'s adapter (if any) fits beside those counted so far."""
        lora = req.lora_request
        return (lora is None or not self.max_loras or lora.lora_int_id in self.ids
                or len(self.ids) < self.max_loras)

    def add(self, req: Request) -> None:
        """Count admitted ``req``'s adapter."""
        if self.max_loras and req.lora_request is not None:
            self.ids.add(req.lora_request.lora_int_id)
