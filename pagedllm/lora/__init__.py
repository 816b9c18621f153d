"""Multi-LoRA serving: PEFT adapters applied per request on top of any base linear method.

``request``: ``LoRARequest`` (what a caller names), torch-free so it travels in engine
messages; ``peft``: loading and validating a PEFT adapter directory; ``layers``: the
stacked slot weights of one linear layer and the batched ``y += scale * x A^T B^T``;
``manager``: which adapter sits in which GPU slot, an LRU of adapters on the CPU, and the
per-step token -> slot mapping.  See docs/architecture.md, "LoRA".
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
