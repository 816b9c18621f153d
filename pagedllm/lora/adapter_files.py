"""The files of a PEFT LoRA adapter, checked without torch (the API server and the
offline frontend validate an adapter before any request uses it).

```
 adapter_config.json        r, lora_alpha, use_rslora, target_modules, ...
 adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]
                            base_model.model.<module>.lora_B.weight  [out, r]
```

``check_adapter`` reads the config and the safetensors file (header: names, dtypes,
shapes, byte ranges that must match shape x dtype and lie in the file; then every tensor,
decoded to float32 with numpy and checked finite) and checks them against the model's
config; every problem (missing or corrupt files, an unknown dtype, a rank above
``max_lora_rank``, a module or shape the model does not have, NaN or inf weights) is a
``ValueError`` naming the adapter.  ``worker/lora/peft.py`` builds the device half from
the arrays read here, so the engine runs exactly what was checked.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.lora.request import LoRARequest
from pagedllm.model_files.safe_open import open_regular

# HF module name -> (our fused module, shard index within it).
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Our fused module -> how many shards it has.
NUM_SHARDS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
PEFT_PREFIX = "base_model.model."
# The safetensors dtypes an adapter may use: name -> little-endian numpy dtype (BF16 is
# read as its 16 high bits of a float32).
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def adapter_error(req: LoRARequest, why: str) -> ValueError:
    return ValueError(f"lora_request: adapter {req.lora_name!r} ({req.lora_path}): {why}")


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
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
        # A regular file of at most 1 MiB: a FIFO here blocked the tokenizer thread.
        with open_regular(path, max_bytes=1 << 20, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise adapter_error(req, "no adapter_config.json there") from None
    except (OSError, ValueError) as e:
        raise adapter_error(req, f"adapter_config.json is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise adapter_error(req, "adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise adapter_error(req, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise adapter_error(req, f"r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise adapter_error(req, f"rank {r} exceeds max_lora_rank {max_lora_rank}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key)) != ok:
            raise adapter_error(req, f"{key}={cfg.get(key)!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise adapter_error(req, f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise adapter_error(req, "modules_to_save is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise adapter_error(req, f"{key} is not supported")
    return cfg



@dataclass
class AdapterInfo:
    """What ``check_adapter`` found: the tensors' file, PEFT's ``scale`` and, per HF
    module (``model.layers.0.self_attn.q_proj``), its rank."""

    weights_path: str
    scale: float
    ranks: dict[str, int]
    # Every tensor of the file by name, float32 (checked finite).
    tensors: dict[str, np.ndarray]


def _header(req: LoRARequest, path: str) -> dict[str, Any]:
    """The safetensors header, its byte ranges checked against the file size."""
    try:
        with open_regular(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        for name, t in header.items():
            lo, hi = t["data_offsets"]
            if not 0 <= lo <= hi <= size - 8 - n:
                raise ValueError(f"tensor {name!r} lies outside the file")
            shape = t["shape"]
            if not isinstance(shape, list) or not all(
                    type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"tensor {name!r} has no valid shape")
            if t["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {t['dtype']!r}, not one of "
                                 f"{', '.join(SAFETENSORS_DTYPES)}")
            need = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[t["dtype"]]).itemsize
            if hi - lo != need:
                raise ValueError(f"tensor {name!r}: data_offsets [{lo}, {hi}] hold "
                                 f"{hi - lo} bytes, its shape {shape} in {t['dtype']} "
                                 f"needs {need}")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise adapter_error(req, f"adapter_model.safetensors is corrupt ({e})") from None
    return header


def _read_tensors(req: LoRARequest, path: str, header: dict[str, Any],
                  ) -> dict[str, np.ndarray]:
    """Every tensor of the checked ``header``, read in full as float32; a tensor with a
    NaN or an infinity is refused."""
    try:
        with open_regular(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(8 + n)
            data = f.read()
    except (OSError, struct.error) as e:
        raise adapter_error(req, f"adapter_model.safetensors is unreadable ({e})") from None
    out: dict[str, np.ndarray] = {}
    for name, t in header.items():
        lo, hi = t["data_offsets"]
        if hi > len(data):  # the file shrank since its header was read
            raise adapter_error(req, f"adapter_model.safetensors is corrupt (tensor "
                                     f"{name!r} lies outside the file)")
        raw = np.frombuffer(data, dtype=SAFETENSORS_DTYPES[t["dtype"]],
                            count=math.prod(t["shape"]), offset=lo)
        if t["dtype"] == "BF16":
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.astype(np.float32)
        arr = arr.reshape(t["shape"])
        if not np.isfinite(arr).all():
            raise adapter_error(req, f"tensor {name!r} holds non-finite weights (NaN or "
                                     "inf)")
        out[name] = arr
    return out


def check_adapter(req: LoRARequest, max_lora_rank: int, hf_config: Any) -> AdapterInfo:
    """Validate ``req``'s adapter against the model ``hf_config`` describes."""
    cfg = read_config(req, max_lora_rank)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    path = os.path.join(req.lora_path, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise adapter_error(req, "no adapter_model.safetensors there")
    header = _header(req, path)
    shapes = expected_shapes(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, t in header.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                module = name[:-len(suffix)].removeprefix(PEFT_PREFIX)
                pairs.setdefault(module, {})[part] = list(t["shape"])
                break
        else:
            raise adapter_error(req, f"unexpected tensor {name!r}")
    if not pairs:
        raise adapter_error(req, "adapter_model.safetensors holds no LoRA weights")
    ranks: dict[str, int] = {}
    for module, ab in sorted(pairs.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in PACKED_MODULES or ".layers." not in module:
            raise adapter_error(req, f"target module {module!r} is not supported (attention and "
                             "MLP projections of decoder layers only)")
        try:
            layer = int(module.split(".layers.")[1].split(".")[0])
        except ValueError:
            raise adapter_error(req, f"cannot read the layer of {module!r}") from None
        if not 0 <= layer < num_layers:
            raise adapter_error(req, f"{module!r}: the model has {num_layers} layers")
        if set(ab) != {"lora_A", "lora_B"}:
            raise adapter_error(req, f"{module!r} lacks its lora_A or lora_B weight")
        a, b = ab["lora_A"], ab["lora_B"]
        n_in, n_out = shapes[leaf]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[1] != n_in or b[0] != n_out:
            raise adapter_error(req, f"{module!r}: lora_A {tuple(a)} / lora_B {tuple(b)} do not "
                             f"fit the model's [{n_out}, {n_in}]")
        if a[0] > max_lora_rank:
            raise adapter_error(req, f"rank {a[0]} exceeds max_lora_rank {max_lora_rank}")
        ranks[module] = int(a[0])
    return AdapterInfo(path, scale, ranks, _read_tensors(req, path, header))
