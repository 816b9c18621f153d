"""The frontend's record of adapters: each ``LoRARequest`` checked once (torch-free).

The offline ``LLM`` and the API server validate an adapter here before any request
uses it, so a bad one is a ``ValueError`` naming it (a 400 from the server) and never
reaches the engine core, whose workers load only adapters that passed.  One
``lora_int_id`` must keep naming one adapter directory.
"""

from __future__ import annotations

from typing import Any

from pagedllm.lora.adapter_files import check_adapter
from pagedllm.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, lora_config: Any, hf_config: Any) -> None:
        """``lora_config``: the engine's ``LoRAConfig`` (None: LoRA off)."""
        self.lora_config = lora_config
        self.hf_config = hf_config
        self.checked: dict[int, LoRARequest] = {}

    def check(self, req: LoRARequest | None) -> None:
        """``ValueError`` naming ``lora_request`` unless ``req`` may run (None may)."""
        if req is None:
            return
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request: LoRA is not enabled (start the engine with "
                             "enable_lora=True / --enable-lora)")
        seen = self.checked.get(req.lora_int_id)
        if seen is not None:
            if seen.lora_path != req.lora_path:
                raise ValueError(f"lora_request: lora_int_id {req.lora_int_id} already "
                                 f"names adapter {seen.lora_name!r} at {seen.lora_path}")
            return
        check_adapter(req, self.lora_config.max_lora_rank, self.hf_config)
        self.checked[req.lora_int_id] = req

    def forget(self, lora_int_id: int) -> None:
        self.checked.pop(lora_int_id, None)
