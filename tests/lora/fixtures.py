"""Adapters made by the real ``peft`` library on a tiny random Llama, and the
transformers + PEFT greedy reference.

PEFT initialises ``lora_B`` to zero (an adapter that changes nothing); every LoRA
weight here is redrawn so each adapter visibly changes the output."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from tests.models.tiny_models import randomize

# (name, r, lora_alpha, use_rslora, target modules): every projection, attention only,
# MLP + o_proj -- fused shards present and absent.
ADAPTERS = [
    ("all", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]),
    ("attn", 4, 8, True, ["q_proj", "v_proj"]),
    ("mlp", 8, 4, False, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
]


@dataclass
class AdapterFixture:
    name: str
    path: str
    peft_model: Any  # transformers model with this adapter (PEFT, unmerged)
    merged: Any  # the same, merged into the base weights


def make_adapters(base: torch.nn.Module, root: str, specs: list[tuple] = ADAPTERS,
                  seed: int = 1, scale: float = 0.3, merge: bool = True,
                  ) -> list[AdapterFixture]:
    """One PEFT adapter directory per spec under ``root``, LoRA weights random
    (``merge``: also build the merged model)."""
    import peft

    out = []
    for i, (name, r, alpha, rslora, targets) in enumerate(specs):
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
            lora_dropout=0.0))
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        path = os.path.join(root, name)
        pm.save_pretrained(path)
        pm.eval()
        merged = copy.deepcopy(pm).merge_and_unload().eval() if merge else None
        out.append(AdapterFixture(name, path, pm, merged))
    return out


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache (no EOS: the reference)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    toks: list[int] = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        toks.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return toks


def tiny_llama(path: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random Llama (GQA 2:1) saved as safetensors at ``path``."""
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    randomize(hf, seed=5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf
