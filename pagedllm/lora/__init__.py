"""Multi-LoRA serving: PEFT adapters applied per request on top of any base linear method.

This is the torch-free half: ``request``: ``LoRARequest`` (what a caller names), so it
travels in engine messages; ``adapter_files``: reading and checking a PEFT adapter
directory; ``registry``: the adapters the frontend knows by name.  The device half is
``pagedllm/worker/lora/``.  See docs/architecture.md, "LoRA".
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
