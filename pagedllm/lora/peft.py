"""Loading and validating a PEFT LoRA adapter directory.

```
 adapter_config.json        r, lora_alpha, use_rslora, target_modules, ...
 adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]
                            base_model.model.<module>.lora_B.weight  [out, r]
```

PEFT computes ``y = W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``).  Our models fuse q/k/v and gate/up (``models/llama.py``), so a
``q_proj`` adapter becomes shard ``"q"`` of ``qkv_proj``: ``LoRAAdapter.modules`` maps the
*fused* module name to one ``LoRAWeights`` per shard (None where the adapter leaves a
shard alone).  Every problem (missing or corrupt files, a rank above ``max_lora_rank``,
a module or shape the model does not have) is a ``ValueError`` naming the adapter.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.lora.request import LoRARequest

# HF module name -> (our fused module, shard index within it).
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Our fused module -> how many shards it has.
NUM_SHARDS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_PREFIX = "base_model.model."


@dataclass
class LoRAWeights:
    """One (unfused) module's adapter: ``lora_a [r, in]``, ``lora_b [out, r]`` (fp32 on
    the CPU, full size: tensor-parallel ranks take their slice when loading a slot)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded adapter: fused module name (``model.layers.0.self_attn.qkv_proj``) ->
    per-shard weights."""

    request: LoRARequest
    rank: int
    modules: dict[str, list[LoRAWeights | None]]


def _fail(req: LoRARequest, why: str) -> ValueError:
    return ValueError(f"lora_request: adapter {req.lora_name!r} ({req.lora_path}): {why}")


def _expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of every HF projection of a Llama-family layer."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    hd = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = int(getattr(hf_config, "intermediate_size", 0) or 0)
    return {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd),
            "v_proj": (hidden, kv * hd), "o_proj": (heads * hd, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def read_config(req: LoRARequest, max_lora_rank: int) -> dict[str, Any]:
    """``adapter_config.json``, checked for what we support."""
    path = os.path.join(req.lora_path, "adapter_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise _fail(req, "no adapter_config.json there") from None
    except (OSError, ValueError) as e:
        raise _fail(req, f"adapter_config.json is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(req, "adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(req, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(req, f"r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise _fail(req, f"rank {r} exceeds max_lora_rank {max_lora_rank}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key)) != ok:
            raise _fail(req, f"{key}={cfg.get(key)!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _fail(req, f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _fail(req, "modules_to_save is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _fail(req, f"{key} is not supported")
    return cfg


def load_adapter(req: LoRARequest, max_lora_rank: int, hf_config: Any) -> LoRAAdapter:
    """Read and validate ``req``'s adapter against the model ``hf_config`` describes."""
    cfg = read_config(req, max_lora_rank)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    path = os.path.join(req.lora_path, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise _fail(req, "no adapter_model.safetensors there")
    try:
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
    except Exception as e:  # safetensors raises its own error types on bad files
        raise _fail(req, f"adapter_model.safetensors is corrupt ({e})") from None
    shapes = _expected_shapes(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                module = name[:-len(suffix)].removeprefix(_PREFIX)
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise _fail(req, f"unexpected tensor {name!r}")
    if not pairs:
        raise _fail(req, "adapter_model.safetensors holds no LoRA weights")
    modules: dict[str, list[LoRAWeights | None]] = {}
    for module, ab in sorted(pairs.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in PACKED_MODULES or ".layers." not in module:
            raise _fail(req, f"target module {module!r} is not supported (attention and "
                             "MLP projections of decoder layers only)")
        try:
            layer = int(module.split(".layers.")[1].split(".")[0])
        except ValueError:
            raise _fail(req, f"cannot read the layer of {module!r}") from None
        if not 0 <= layer < num_layers:
            raise _fail(req, f"{module!r}: the model has {num_layers} layers")
        if set(ab) != {"lora_A", "lora_B"}:
            raise _fail(req, f"{module!r} lacks its lora_A or lora_B weight")
        a, b = ab["lora_A"].float(), ab["lora_B"].float()
        n_in, n_out = shapes[leaf]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or \
                a.shape[1] != n_in or b.shape[0] != n_out:
            raise _fail(req, f"{module!r}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)} do not fit the model's [{n_out}, {n_in}]")
        if a.shape[0] > max_lora_rank:
            raise _fail(req, f"rank {a.shape[0]} exceeds max_lora_rank {max_lora_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _fail(req, f"{module!r} holds non-finite weights")
        fused, shard = PACKED_MODULES[leaf]
        key = module[:-len(leaf)] + fused
        modules.setdefault(key, [None] * NUM_SHARDS[fused])[shard] = LoRAWeights(
            a.contiguous(), b.contiguous(), scale)
    rank = max(w.rank for ws in modules.values() for w in ws if w is not None)
    return LoRAAdapter(req, rank, modules)
