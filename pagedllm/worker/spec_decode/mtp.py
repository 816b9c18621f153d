"""The ``mtp`` proposer (``speculative_config={"method": "mtp", "num_speculative_tokens":
k}``; vLLM's ``"deepseek_mtp"`` is an alias): a DeepSeek-V3 checkpoint's own
multi-token-prediction layer (``models/deepseek_mtp.py``) drafts from the target's
hidden states.

It is driven exactly as an EAGLE-1 head (``eagle_proposer.EagleProposer``: the layer's
entry at position ``p`` reads the token at ``p + 1`` and the target's final-norm state
at ``p``; draft steps 2..k feed its own output back one position on), and its KV is
kept like a draft model's (``draft_model.py``): one MLA latent cache
``[1, num_blocks + scratch, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` whose
block ids are the target's, counted per block in the memory plan.  That cache's shape
and bytes come from ``draft_model_config``, which ``mtp_draft_config`` makes from the
target's ``ModelConfig`` (its HF config copied with ``num_hidden_layers = 1``: one
layer of the target's MLA sizes); the layer itself is built from the target's own
config, at index ``num_hidden_layers``, and loaded from the target's checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from pagedllm.models.deepseek_mtp import DeepseekMTP, mtp_prefix


def _err(msg: str) -> ValueError:
    return ValueError(f"speculative_config: {msg}")


def is_deepseek_v3(hf_config: Any) -> bool:
    """Whether ``hf_config`` runs as ``DeepseekV3ForCausalLM`` (V3, R1, Kimi-K2,
    Moonlight: the graph MTP layers were released for)."""
    from pagedllm.models.deepseek_v2 import DeepseekV3ForCausalLM
    from pagedllm.models.registry import get_model_class

    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return False
    return issubclass(cls, DeepseekV3ForCausalLM)


def check_mtp_shapes(hf_config: Any, shapes: dict[str, list[int]]) -> None:
    """ValueError naming ``speculative_config`` unless ``shapes`` (a checkpoint's tensor
    shapes) hold the MTP layer's own tensors with the target's sizes."""
    prefix = mtp_prefix(hf_config)
    h = int(hf_config.hidden_size)
    want = {"enorm.weight": [h], "hnorm.weight": [h], "eh_proj.weight": [h, 2 * h],
            "shared_head.norm.weight": [h]}
    for name, shape in want.items():
        got = shapes.get(prefix + name)
        if got != shape:
            raise _err(f"method 'mtp' needs the target checkpoint's MTP layer: tensor "
                       f"{prefix}{name} of shape {shape}, got "
                       f"{'none' if got is None else got}")


def mtp_draft_config(target: Any, world_size: int) -> Any:
    """The ``draft_model_config`` of method "mtp" for ``target`` (the target's
    ``ModelConfig``): the target's, its HF config a copy with ``num_hidden_layers = 1``
    (the MTP layer's KV shape and bytes per token).  ValueError naming
    ``speculative_config`` when the target has no MTP layer to draft with: not
    DeepSeek-V3-family, ``num_nextn_predict_layers`` 0 or absent, a checkpoint without
    the layer's tensors, a GGUF file, or several ranks."""
    hf = target.hf_config
    if not is_deepseek_v3(hf):
        archs = list(getattr(hf, "architectures", None) or [getattr(hf, "model_type", "?")])
        raise _err(f"method 'mtp' drafts with a DeepSeek-V3 checkpoint's multi-token-"
                   f"prediction layer; the target model is {', '.join(map(str, archs))}")
    layers = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
    if layers < 1:
        raise _err("method 'mtp' needs a target with an MTP layer; its config has "
                   f"num_nextn_predict_layers={getattr(hf, 'num_nextn_predict_layers', None)}")
    if world_size != 1:
        raise _err("the MTP layer runs on one rank only; use tensor_parallel_size 1")
    if target.load_format not in ("safetensors", "dummy"):
        raise _err(f"method 'mtp' reads the MTP layer from safetensors (or dummy "
                   f"weights), not load_format {target.load_format!r}")
    if target.load_format == "safetensors":
        from pagedllm.worker.spec_decode.eagle import checkpoint_shapes

        check_mtp_shapes(hf, checkpoint_shapes(target.resolved.directory))
    kv_view = copy.copy(hf)
    kv_view.num_hidden_layers = 1
    return dataclasses.replace(target, hf_config=kv_view)


def load_mtp(model_config: Any, target: nn.Module, device: torch.device) -> DeepseekMTP:
    """The MTP layer of ``target`` (a loaded ``DeepseekV3ForCausalLM``; its config says
    where the layer is) on ``device``, in ``model_config``'s dtype and quantisation,
    loaded from ``model_config``'s checkpoint (only the layer's tensors are read) or
    dummy-initialised.  Without ``embed_tokens`` / ``shared_head.head`` in the
    checkpoint (and always with dummy weights) it uses the target's."""
    from pagedllm.models.loader import (
        _DTYPES,
        _default_dtype,
        _init_dummy,
        finish_loading,
        iter_safetensors,
        make_quant_config,
    )

    config = target.config  # type: ignore[attr-defined]
    prefix = mtp_prefix(config)
    dummy = model_config.load_format == "dummy"
    names: set[str] = set()
    if not dummy:
        from pagedllm.worker.spec_decode.eagle import checkpoint_shapes

        names = set(checkpoint_shapes(model_config.resolved.directory))
    quant_config = make_quant_config(model_config, torch.device(device))
    with _default_dtype(_DTYPES[model_config.dtype]), torch.device(device):
        mtp = DeepseekMTP(config, target, quant_config,
                          own_embed=f"{prefix}embed_tokens.weight" in names,
                          own_head=f"{prefix}shared_head.head.weight" in names)
    if dummy:
        _init_dummy(mtp, torch.device(device), int(model_config.seed),
                    model_config.dummy_init)
    else:
        mtp.load_weights(iter_safetensors(model_config.resolved.directory,
                                          lambda name: name.startswith(prefix)))
    finish_loading(mtp)
    return mtp.eval()
