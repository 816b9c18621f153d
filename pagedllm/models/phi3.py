"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's graph with the projections fused in the
checkpoint -- ``self_attn.qkv_proj`` (``[q | k | v]`` rows) and ``mlp.gate_up_proj``
(``[gate | up]``) -- and LongRoPE (``longrope``/``su``) scaling, partial rotary on
Phi-4-mini (``layers/rotary.py``).

The fused checkpoint tensors are split into their q/k/v and gate/up parts at load time
and handed to the fused parameters' loaders shard by shard, so tensor-parallel sharding
and quantisation methods see the same per-shard calls as for Llama checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]],
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        hd = head_dim_of(cfg)
        q = cfg.num_attention_heads * hd
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * hd
        for name, t in weights:
            if ".self_attn.qkv_proj." in name:
                if t.shape[0] != q + 2 * kv:
                    raise ValueError(f"checkpoint tensor {name!r}: {t.shape[0]} rows, "
                                     f"expected q {q} + k {kv} + v {kv}")
                for part, piece in zip(("q_proj", "k_proj", "v_proj"),
                                       t.split([q, kv, kv])):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".mlp.gate_up_proj." in name:
                if t.shape[0] % 2:
                    raise ValueError(f"checkpoint tensor {name!r}: odd row count "
                                     f"{t.shape[0]} for [gate | up]")
                gate, up = t.chunk(2)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))
