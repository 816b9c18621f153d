"""Dummy LoRA adapters for ``pagedllm bench throughput|latency --lora N``.

Writes ``N`` PEFT-format adapter directories (``adapter_config.json`` +
``adapter_model.safetensors``) of rank ``--lora-rank`` on every attention and MLP
projection of the model's shape, random small weights, to a temp dir: the issue's "8
dummy rank-16 adapters" on any ``--dummy`` shape, no ``peft`` needed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from pagedllm.lora.adapter_files import PEFT_PREFIX, expected_shapes
from pagedllm.lora.request import LoRARequest


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="Run with N dummy LoRA adapters (requests spread evenly over "
                        "them; implies --enable-lora and --max-loras N unless given).")
    p.add_argument("--lora-rank", type=int, default=16, help="Rank of the --lora adapters.")


def apply_lora_bench_args(args: argparse.Namespace) -> None:
    """Turn ``--lora N`` into the engine flags it needs (before the engine is built)."""
    if args.lora < 0:
        raise ValueError(f"--lora must be >= 0, got {args.lora}")
    if args.lora:
        args.enable_lora = True
        if args.max_loras == 1:
            args.max_loras = args.lora
        args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)


def write_dummy_adapters(hf_config: Any, n: int, rank: int, seed: int = 0,
                         ) -> list[LoRARequest]:
    import torch
    from safetensors.torch import save_file

    root = tempfile.mkdtemp(prefix="pagedllm-lora-")
    shapes = expected_shapes(hf_config)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        path = os.path.join(root, f"lora{i}")
        os.makedirs(path)
        tensors = {}
        for layer in range(int(hf_config.num_hidden_layers)):
            for leaf, (n_in, n_out) in shapes.items():
                part = "self_attn" if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") \
                    else "mlp"
                name = f"{PEFT_PREFIX}model.layers.{layer}.{part}.{leaf}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) \
                    * n_in ** -0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) \
                    * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": sorted(shapes), "bias": "none"}, f)
        out.append(LoRARequest(f"lora{i}", i + 1, path))
    return out


def spread(loras: list[LoRARequest], n: int) -> list[LoRARequest | None] | None:
    """Request i gets adapter ``i % N`` (None when there are no adapters)."""
    return [loras[i % len(loras)] for i in range(n)] if loras else None
