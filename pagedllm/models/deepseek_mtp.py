"""DeepSeek-V3's multi-token-prediction (MTP) layer: the extra decoder layer a V3 / R1
checkpoint carries at index ``N = num_hidden_layers`` (``num_nextn_predict_layers`` of
them; transformers' model ignores them), used as a speculative-decoding proposer
(``speculative_config={"method": "mtp"}``, ``worker/spec_decode/mtp.py``).  The math is
vLLM's ``deepseek_mtp.py`` (what the published checkpoints were trained for)::

 entry p (h_p: the target's final-norm output at position p; t_{p+1}: the next token)
   e   = embed(t_{p+1}),  zeroed at p = 0           (vLLM: "not needed by MTP")
   x   = eh_proj(cat(enorm(e), hnorm(h_p)))         eh_proj: [H, 2H], no bias
   a, r = decoder_layer(x) at position p            MLA (own latent KV) + MoE/dense MLP
   g_p = a + r                                      (the layer's pre-norm output)
   logits = head(shared_head.norm(g_p))  -> t_{p+2}  head: shared_head.head, or the
                                                    target's lm_head when absent
 draft step j >= 2: h := g of step j - 1, t := the previous draft, one position on

The decoder layer runs at the position of the hidden state it reads (p), as vLLM feeds
it (the target's positions, the ids shifted by one); p + 1 would attend the same (RoPE
sees relative distances only), but the position-0 mask above is p's.  Only the first MTP
layer (index ``N``) is built; vLLM cycles through several for several draft steps, but
every released checkpoint has one, and vLLM applies that one at every step, as here.

Checkpoint names (under ``model.layers.{N}.``): ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, ``shared_head.head`` (optional), ``embed_tokens`` (optional:
the target's otherwise), and the decoder layer's usual names (``self_attn.*``,
``mlp.*`` with DeepSeekMoE's expert names, ``input_layernorm``,
``post_attention_layernorm``).  The RoPE table and, when absent from the checkpoint,
the embedding and LM head are the target's (not submodules here: neither loaded nor
counted twice).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_torch import MLATorchBackend
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import load_weight
from pagedllm.layers.mla import MultiHeadLatentAttention
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.deepseek_moe import deepseek_moe_weight_target
from pagedllm.models.deepseek_v2 import bind_mla_caches, make_deepseek_mlp
from pagedllm.models.llama import LlamaDecoderLayer

# Checkpoint names of the MTP layer's own parts (the rest is its decoder layer).
MTP_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
_STACKED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def mtp_prefix(config: Any) -> str:
    """The checkpoint prefix of the (first) MTP layer: ``model.layers.{N}.``."""
    return f"model.layers.{int(config.num_hidden_layers)}."


class SharedHead(nn.Module):
    """``norm`` and, when the checkpoint has one, the layer's own LM ``head``."""

    def __init__(self, config: Any, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(int(config.hidden_size), float(config.rms_norm_eps))
        self.head: nn.Module | None = ParallelLMHead(
            int(config.vocab_size), int(config.hidden_size),
            prefix=f"{mtp_prefix(config)}shared_head.head") if own_head else None


class DeepseekMTP(nn.Module):
    """The MTP layer of ``config`` (the target's HF config) drafting for ``target`` (a
    pagedllm ``DeepseekV3ForCausalLM``), in the interface ``EagleProposer`` drives:

    * ``target_hidden(rows [T, H]) -> [T, H]``: the target's per-token states as this
      layer reads them (the final-norm output, as is)
    * ``forward(ids [T], positions [T], hidden [T, H], meta) -> (g, g)``: the layer's
      pre-norm output (what the logits read, and the next draft step's ``hidden``);
      writes each real token's latent KV entry into its cache at ``meta.slot_mapping``
    * ``compute_logits(g [N, H]) -> [N, vocab]``; ``draft_tokens(g) -> [N]`` their argmax
    * ``bind_kv_caches([cache])``: the one MLA latent cache ``[1, blocks, bs, 1, L + R]``
    * ``load_weights(iterable of (name, tensor))``: checkpoint names, any tensor not
      under ``model.layers.{N}.`` skipped

    ``own_embed`` / ``own_head``: the checkpoint has ``embed_tokens`` /
    ``shared_head.head`` under the layer's prefix (else the target's are used).
    ``quant_config``: the target's, for the decoder layer's linear layers and experts
    (``eh_proj`` and the head stay in the model dtype, as in vLLM)."""

    def __init__(self, config: Any, target: nn.Module,
                 quant_config: QuantizationConfig | None = None, *,
                 own_embed: bool = False, own_head: bool = False) -> None:
        super().__init__()
        self.config = config
        self.layer_index = int(config.num_hidden_layers)
        prefix = mtp_prefix(config).rstrip(".")
        h, eps = int(config.hidden_size), float(config.rms_norm_eps)
        # Its own MLA backend: it caches the plan of the last metadata it saw.
        self.mla_backend = MLATorchBackend()
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        attn = MultiHeadLatentAttention(config, self.mla_backend, quant_config,
                                        f"{prefix}.self_attn")
        self.mtp_block = LlamaDecoderLayer(
            config, attn, quant_config, prefix,  # type: ignore[arg-type]
            make_deepseek_mlp(config, self.layer_index, quant_config, f"{prefix}.mlp"))
        self.shared_head = SharedHead(config, own_head)
        self.embed_tokens: nn.Module | None = VocabParallelEmbedding(
            int(config.vocab_size), h) if own_embed else None
        self.__dict__["target"] = target  # not a submodule: the target's own

    @property
    def target(self) -> nn.Module:
        return self.__dict__["target"]

    def target_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed_tokens if self.embed_tokens is not None \
            else self.target.model.embed_tokens  # type: ignore[union-attr]
        e = emb(ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        rope = self.target.model.rotary_emb.inputs(  # type: ignore[union-attr]
            positions, x.dtype)
        a, r = self.mtp_block(rope, x, None, meta)
        g = a + r
        return g, g

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        x = self.shared_head.norm(g)
        head = self.shared_head.head
        if head is None:
            return self.target.compute_logits(x)  # type: ignore[operator]
        return head(x)

    def draft_tokens(self, g: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(g).argmax(dim=-1)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        bind_mla_caches([self.mtp_block.self_attn], kv_caches)  # type: ignore[list-item]

    # -- weights -----------------------------------------------------------------------
    def param_name(self, name: str) -> tuple[str, tuple[Any, ...]] | None:
        """``(parameter name, weight_loader args)`` of checkpoint tensor ``name``, None
        when it is not this layer's (another layer, another MTP layer)."""
        prefix = mtp_prefix(self.config)
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        if rest.split(".", 1)[0] in MTP_PARTS:
            return rest, ()
        rest = f"mtp_block.{rest}"
        hit = deepseek_moe_weight_target(rest)
        if hit is not None:
            return hit
        for fused, part, shard in _STACKED:
            if f".{part}." in rest:
                return rest.replace(f".{part}.", f".{fused}."), (shard,)
        return rest, ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the layer's tensors from the target's checkpoint (every other tensor is
        skipped).  ``ValueError`` naming ``speculative_config`` on a tensor of the layer
        that fits no parameter, and listing parameters the checkpoint lacks; a tied
        target embedding or head is not reloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self._with_kv_scales(weights):
            if "rotary_emb" in name:
                continue
            hit = self.param_name(name)
            if hit is None:
                continue
            target, shard = hit
            param = params.get(target)
            if param is None:
                raise ValueError(f"speculative_config: MTP checkpoint tensor {name!r} "
                                 f"matches no parameter of the MTP layer")
            try:
                load_weight(param, tensor, *shard)
            except ValueError as e:
                raise ValueError(f"speculative_config: MTP checkpoint tensor {name!r}: "
                                 f"{e}") from e
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"speculative_config: the checkpoint lacks {len(missing)} "
                             f"tensor(s) of the MTP layer {mtp_prefix(self.config)}*: "
                             f"{shown}")

    def _with_kv_scales(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's ``self_attn.k_scale`` of the layer becomes its attention's
        ``k_scale`` (an fp8 latent cache's scale, ``loader.take_kv_scales``)."""
        from pagedllm.models.loader import take_kv_scales

        prefix = mtp_prefix(self.config)
        renamed = ((f"mtp_block.{n[len(prefix):]}" if n.startswith(prefix)
                    and n.endswith(("self_attn.k_scale", "self_attn.v_scale")) else n, t)
                   for n, t in weights)
        yield from take_kv_scales(self, renamed)
