"""Adapter slots on the device, an LRU of adapters on the CPU, and the step's mapping.

```
 CPU LRU (max_cpu_loras)      device slots (max_loras)        LoRALinear per layer
 id 7: LoRAAdapter  ───load──► slot 0: id 7  ─────────────────► A[0], Bt[0]
 id 3: LoRAAdapter            slot 1: id 3                      A[1], Bt[1]
 (disk read on a miss)        slot 2: free
```

Each step ``prepare_step`` makes every adapter of the step's requests resident (the
scheduler admits at most ``max_loras`` distinct adapters per step, so they always fit):
a missing one takes a free slot, else the least recently used slot whose adapter is not
in this step -- an adapter in use is never evicted.  The CPU cache (``max_cpu_loras``
>= ``max_loras``) evicts its least recently used adapter that is not in a slot; an
evicted one is read from disk again when next needed.  Then the token -> slot map
is copied to the device (one staged copy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.lora.adapter_files import NUM_SHARDS
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.lora.layers import LoRALinear, LoRAMapping
from pagedllm.worker.lora.peft import LoRAAdapter, load_adapter


def lora_target_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers adapters can target (by HF module name, fused)."""
    from pagedllm.layers.linear import LinearBase

    return {m.prefix: m for m in model.modules()
            if isinstance(m, LinearBase) and m.prefix.rsplit(".", 1)[-1] in NUM_SHARDS
            and ".layers." in m.prefix}


def runs_on_pruned_rows(name: str, last_layer: int) -> bool:
    """Whether module ``name`` runs on the rows the model's ``last_only`` pruning keeps:
    the last decoder layer's modules after attention (``models/llama.py`` selects the
    rows on the attention output, before ``o_proj``)."""
    layer = int(name.split(".layers.")[1].split(".")[0])
    return layer == last_layer and not name.endswith("qkv_proj")


def link_norms(model: nn.Module) -> None:
    """Give each decoder layer's RMSNorm the ``LoRALinear`` of the projection that reads
    its output (``layers/norm.norm_readers``): at batch 1 the norm's launch then computes
    that projection's shrink (``LoRALinear.norm``).  A projection that gets another
    tensor runs its own shrink, so a model that does not fit the pattern stays correct."""
    from pagedllm.layers.norm import norm_readers

    for n, lin in norm_readers(model):
        if getattr(lin, "lora", None) is not None:
            n.lora_next = lin.lora


def activation_dtype(model_config: Any) -> torch.dtype:
    """The slots' dtype: the model's activation dtype (``ModelConfig.dtype``), not a
    parameter's: a quantised layer stores its weight packed (GGUF Q4_1: uint8), yet the
    delta ``x A^T Bt`` is computed on its input and added to its output, both in the
    activation dtype, whatever the base weight's format."""
    return getattr(torch, model_config.dtype)


def lora_slot_bytes(model: nn.Module, max_loras: int, max_lora_rank: int,
                    dtype: torch.dtype) -> int:
    """Device bytes the adapter slots of ``model`` take (what the memory plan sets aside
    before sizing the KV cache)."""
    return max_loras * sum(LoRALinear.bytes_per_slot(layer, max_lora_rank, dtype)
                           for layer in lora_target_layers(model).values())


class LoRAManager:
    """Owns the adapters' device slots and host copies for one model (one per rank)."""

    def __init__(self, model: nn.Module, hf_config: Any, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, max_num_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """Attach ``LoRALinear`` slots to every target layer of ``model``."""
        self.hf_config = hf_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.mapping = LoRAMapping(max_num_tokens, device, max_loras)
        use_triton = device.type == "cuda"
        self.layers: dict[str, LoRALinear] = {}
        last = int(hf_config.num_hidden_layers) - 1
        for name, layer in lora_target_layers(model).items():
            lora = LoRALinear(layer, max_loras, max_lora_rank, self.mapping, dtype, device,
                              use_triton, last_rows=runs_on_pruned_rows(name, last))
            layer.lora = lora  # the hook LinearBase.forward calls
            self.layers[name] = lora
        link_norms(model)
        self.slot_ids: list[int | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # slot, oldest first
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._prev_tokens = 0

    # -- the CPU cache ---------------------------------------------------------------
    def _host_adapter(self, req: LoRARequest) -> LoRAAdapter:
        ad = self.cpu.get(req.lora_int_id)
        if ad is None:
            ad = load_adapter(req, self.max_lora_rank, self.hf_config)
            self.cpu[req.lora_int_id] = ad
            # Never drop an adapter sitting in a slot (max_cpu_loras >= max_loras).
            free = [i for i in self.cpu if i not in self._slot_of and i != req.lora_int_id]
            while len(self.cpu) > self.max_cpu_loras and free:
                del self.cpu[free.pop(0)]
        self.cpu.move_to_end(req.lora_int_id)
        return ad

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot and host copy."""
        self.cpu.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None

    # -- device slots -----------------------------------------------------------------
    def _make_resident(self, req: LoRARequest, in_step: set[int]) -> int:
        slot = self._slot_of.get(req.lora_int_id)
        if slot is None:
            free = [s for s, i in enumerate(self.slot_ids) if i is None]
            if free:
                slot = free[0]
            else:
                slot = next(s for s in self._slot_lru if self.slot_ids[s] not in in_step)
                del self._slot_of[self.slot_ids[slot]]  # type: ignore[arg-type]
            # Free from here on: a failure below (a bad adapter) leaves it free.
            self.slot_ids[slot] = None
            ad = self._host_adapter(req)
            for name, layer in self.layers.items():
                layer.set_slot(slot, ad.modules.get(name))
            self.slot_ids[slot] = req.lora_int_id
            self._slot_of[req.lora_int_id] = slot
        self._slot_lru.pop(slot, None)
        self._slot_lru[slot] = None
        return slot

    def prepare_step(self, loras: Sequence[LoRARequest | None], num_new: np.ndarray,
                     h2d: Callable[[str, np.ndarray], torch.Tensor],
                     pruned: bool = False) -> dict[int, str]:
        """Make the step's adapters resident and publish the slot maps.
        ``loras[i]``: scheduled request i's adapter; ``num_new[i]``: its tokens;
        ``pruned``: the model runs its last layer past attention on each request's last
        token only (``last_only`` with a multi-token request), so that layer's map has
        one slot per request.  Returns the adapters that failed to load (``lora_int_id``
        -> why, e.g. files changed or removed since they were checked): their rows run
        without an adapter this step, and the caller fails the requests using them --
        one bad adapter never fails the step."""
        failed: dict[int, str] = {}
        wanted = {r.lora_int_id: r for r in loras if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras "
                               f"({self.max_loras}): the scheduler should prevent it")
        for r in wanted.values():
            if r.lora_int_id not in self._slot_of:
                try:
                    self._make_resident(r, set(wanted))
                except Exception as e:  # noqa: BLE001 - fails its requests, not the step
                    failed[r.lora_int_id] = str(e).strip().splitlines()[0] if str(e) \
                        else type(e).__name__
        if failed:
            loras = [None if r is None or r.lora_int_id in failed else r for r in loras]
        in_step = {r.lora_int_id for r in loras if r is not None}
        m = self.mapping
        if not in_step and self._prev_tokens == 0:
            m.active = False
            return failed
        if len(in_step) > self.max_loras:
            raise RuntimeError(f"{len(in_step)} adapters in one step, more than max_loras "
                               f"({self.max_loras}): the scheduler should prevent it")
        req_slots = np.fromiter(
            (-1 if r is None else self._make_resident(r, in_step) for r in loras),
            np.int32, len(loras))
        tokens = np.repeat(req_slots, num_new)
        m.tokens.publish(tokens, h2d, "lora_tokens")
        m.last.publish(req_slots if pruned else tokens, h2d, "lora_last")
        self._prev_tokens = len(tokens) if in_step else 0
        m.active = bool(in_step)
        return failed


def make_lora_manager(config: Any, model: nn.Module, device: torch.device,
                      ) -> LoRAManager | None:
    """The manager for an engine config with LoRA on (None when off).  The token map
    covers the largest step, eager or a padded CUDA graph."""
    lc = config.lora_config
    if lc is None:
        return None
    sc, dc = config.scheduler_config, config.device_config
    max_tokens = max(sc.max_num_batched_tokens, sc.max_num_seqs,
                     dc.max_cudagraph_capture_size)
    return LoRAManager(model, config.model_config.hf_config, lc.max_loras, lc.max_lora_rank,
                       lc.max_cpu_loras, max_tokens, device,
                       activation_dtype(config.model_config))
