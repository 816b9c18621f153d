"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields).

A msgspec Struct so it travels inside ``EngineCoreRequest`` and the scheduler's
``NewRequestData`` as msgpack (server, multi-process executors) with no pickle.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``lora_int_id`` (>= 1) identifies the adapter everywhere below the frontend: GPU
    slots, the CPU cache and prefix-cache hashes are keyed by it, so one id must always
    name the same weights.  ``lora_name`` is what the server lists and requests choose
    by (``model``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    # The model the server lists the adapter under (``parent`` in /v1/models).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
