"""EAGLE and EAGLE-3 draft heads (``speculative_config={"method": "eagle" | "eagle3",
"model": PATH}``), in the published checkpoint layouts, computing what vLLM's
``llama_eagle.py`` / ``llama_eagle3.py`` compute.

A head is one Llama decoder layer that reads the target's hidden state as well as a token::

 EAGLE-1  (yuhuili/EAGLE-LLaMA3-Instruct-8B: fc.weight [H, 2H], layers.0.*)
   x = fc(cat(embed(t_{p+1}), h_p))          h_p: the target's final-norm output at p
   a, r = layer(x)        (its input_layernorm is skipped, as in EAGLE's cnets.py)
   g_p = a + r            logits = target lm_head(g_p)      next step's h := g_p

 EAGLE-3  (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: fc.weight [H, 3H_t], midlayer.*, norm,
           lm_head [V_d, H], d2t [V_d])
   h_p = fc(cat(aux_2, aux_{L/2}, aux_{L-3}))     aux_i: the target's residual stream
                                                  entering layer i (``AuxHiddenStates``)
   x = cat(input_layernorm(embed(t_{p+1})), hidden_norm(h_p))     qkv in-dim 2H
   a, r = layer(x, residual=h_p)
   o, g_p = norm(a, r)    (normed, pre-norm)      logits = lm_head(o) over the draft
                                                  vocabulary; target id = i + d2t[i]
   next step's h := g_p  (no fc: it is already H wide)

The embedding is the target's unless the checkpoint has ``embed_tokens`` (EAGLE-3 only:
vLLM ignores an EAGLE-1 head's, sharing the target's).  Where this differs from vLLM: an
EAGLE-1 ``fc.bias`` (the original EAGLE trains one) is applied, while vLLM v1 drops it;
the EAGLE-3 draft argmax is taken over the draft vocabulary and mapped through ``d2t``
(vLLM scatters into a -inf target-vocabulary row first: the same token unless two draft
logits tie exactly).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import QKVParallelLinear, load_weight
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of

EAGLE_METHODS = ("eagle", "eagle3")


def _err(msg: str) -> ValueError:
    return ValueError(f"speculative_config: {msg}")


# -- the checkpoint, before anything is built ---------------------------------------------
def _bin_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    # weights_only: no code runs from the file; mmap: only what is read leaves the disk.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_shapes(directory: str) -> dict[str, list[int]]:
    """Every tensor's shape in ``directory``'s ``*.safetensors`` (their JSON headers
    only), else its ``pytorch_model*.bin`` (the published EAGLE heads' format; mapped,
    not read); ValueError naming ``speculative_config`` when it has neither."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        for path in _bin_files(directory):
            shapes.update({k: list(v.shape) for k, v in _torch_load(path).items()})
    if not shapes:
        raise _err(f"{directory} holds no *.safetensors or pytorch_model*.bin weights")
    return shapes


def head_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the head's checkpoint, safetensors or ``.bin``."""
    from pagedllm.models.loader import iter_safetensors

    if glob.glob(os.path.join(directory, "*.safetensors")):
        yield from iter_safetensors(directory)
        return
    for path in _bin_files(directory):
        yield from _torch_load(path).items()


def aux_layer_ids(head_config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream EAGLE-3 reads: the head config's
    ``eagle_aux_hidden_state_layer_ids``, else vLLM's default ``(2, L // 2, L - 3)``."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids:
        return tuple(int(i) for i in ids)
    return (2, target_layers // 2, target_layers - 3)


def check_head(method: str, shapes: dict[str, list[int]] | None, head: Any,
               target: Any) -> None:
    """ValueError naming ``speculative_config`` when the head at hand cannot draft for
    ``target`` (HF configs) with ``method``; ``shapes``: its tensors (None: dummy weights,
    only the configs are checked)."""
    h, ht = int(head.hidden_size), int(target.hidden_size)
    if int(getattr(head, "num_hidden_layers", 1)) != 1:
        raise _err(f"an {method} head has one decoder layer; this one has "
                   f"num_hidden_layers={head.num_hidden_layers}")
    if getattr(head, "add_para_norm", False):
        raise _err("HASS heads (add_para_norm) are not supported")
    if method == "eagle" and h != ht:
        raise _err(f"the eagle head's hidden_size {h} differs from the target's {ht}")
    th = int(getattr(head, "target_hidden_size", None) or ht)
    if th != ht:
        raise _err(f"the eagle3 head's target_hidden_size {th} is not the target's {ht}")
    if method == "eagle3":
        layers = aux_layer_ids(head, int(target.num_hidden_layers))
        if len(layers) != 3 or not all(0 <= i < int(target.num_hidden_layers)
                                       for i in layers):
            raise _err(f"eagle3 reads 3 target layers in [0, {target.num_hidden_layers}), "
                       f"got {layers}")
    if shapes is None:
        return
    fc_in = (2 if method == "eagle" else 3) * ht
    fc = shapes.get("fc.weight")
    if fc != [h, fc_in]:
        raise _err(f"an {method} head needs fc.weight of shape [{h}, {fc_in}] "
                   f"({'2' if method == 'eagle' else '3'} x hidden_size), got {fc}")
    layer = "layers.0" if method == "eagle" else "midlayer"
    q = shapes.get(f"{layer}.self_attn.q_proj.weight")
    q_in = h if method == "eagle" else 2 * h
    if q is None or q[1] != q_in:
        raise _err(f"an {method} head needs {layer}.self_attn.q_proj.weight with in-dim "
                   f"{q_in}, got {q}")
    if method == "eagle3":
        dv = int(getattr(head, "draft_vocab_size", None) or head.vocab_size)
        if shapes.get("lm_head.weight") != [dv, h]:
            raise _err(f"an eagle3 head needs lm_head.weight [{dv}, {h}] (draft_vocab_size "
                       f"x hidden_size), got {shapes.get('lm_head.weight')}")
        if dv != int(target.vocab_size) and shapes.get("d2t") != [dv]:
            raise _err(f"an eagle3 head with draft_vocab_size {dv} < vocab_size needs d2t "
                       f"[{dv}], got {shapes.get('d2t')}")


# -- the heads ------------------------------------------------------------------------------
class _Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's decoder layer: attention over ``cat(input_layernorm(embeds),
    hidden_norm(hidden))`` (qkv in-dim 2H), the residual stream starting at ``hidden``."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        attn = LlamaForCausalLM.make_attention(config, backend, None, "layers.0.self_attn")
        h = config.hidden_size
        attn.qkv_proj = QKVParallelLinear(
            2 * h, attn.head_dim, attn.qkv_proj.total_num_heads,
            attn.qkv_proj.total_num_kv_heads, bias=bool(getattr(config, "attention_bias",
                                                                  False)),
            prefix="layers.0.self_attn.qkv_proj")
        super().__init__(config, attn, None, "layers.0")
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward_eagle3(self, rope: Any, embeds: torch.Tensor, hidden: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)  # type: ignore[assignment]
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)  # type: ignore[assignment]
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)  # type: ignore[misc]
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """One EAGLE (``method="eagle"``) or EAGLE-3 head drafting for ``target`` (a
    pagedllm Llama-family model, whose embedding and, for EAGLE-1, LM head it shares).

    * ``target_hidden(rows)``: the head's ``hidden`` input from the target's per-token
      states (EAGLE-1: the final-norm output, as is; EAGLE-3: ``fc`` over the 3 aux states)
    * ``forward(ids, positions, hidden, meta) -> (for_logits, next_hidden)``
    * ``draft_tokens(for_logits) -> [N]`` greedy draft ids in the target's vocabulary
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: Any, backend: AttentionBackend, target: nn.Module,
                 method: str, *, fc_bias: bool = False, own_embed: bool = False,
                 max_positions: int = 0) -> None:
        """``max_positions``: the RoPE table's length when longer than the config's
        ``max_position_embeddings`` (published EAGLE-3 heads say 2048; the formula
        holds past it, and the target's context is what the head must cover)."""
        super().__init__()
        self.config = config
        self.method = method
        h = config.hidden_size
        th = int(getattr(config, "target_hidden_size", None) or h)
        self.fc = nn.Linear((2 * h) if method == "eagle" else 3 * th, h, bias=fc_bias)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), max(int(config.max_position_embeddings), max_positions),
            rope_parameters(config))
        # Not submodules: the target's own (neither loaded nor counted again here).
        self.__dict__["target"] = target
        self.embed_tokens: nn.Module | None = VocabParallelEmbedding(
            config.vocab_size, h) if own_embed else None
        if method == "eagle":
            attn = LlamaForCausalLM.make_attention(config, backend, None,
                                                   "layers.0.self_attn")
            self.layer: LlamaDecoderLayer = LlamaDecoderLayer(config, attn, None, "layers.0")
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        else:
            self.layer = _Eagle3Layer(config, backend)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            dv = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
            self.lm_head = ParallelLMHead(dv, h, prefix="lm_head")
            # draft id i -> target id i + d2t[i] (identity without a d2t tensor).
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))

    @property
    def target(self) -> nn.Module:
        return self.__dict__["target"]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens if self.embed_tokens is not None \
            else self.target.model.embed_tokens  # type: ignore[union-attr]
        return emb(ids)

    def target_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.method == "eagle" else self.fc(rows)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self._embed(ids)
        rope = self.rotary_emb.inputs(positions, embeds.dtype)
        if self.method == "eagle":
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            a, r = self.layer(rope, x, None, meta)
            g = a + r
            return g, g
        layer: _Eagle3Layer = self.layer  # type: ignore[assignment]
        a, r = layer.forward_eagle3(rope, embeds, hidden, meta)
        out, prenorm = self.norm(a, r)  # type: ignore[misc]
        return out, prenorm

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:
        if self.method == "eagle":
            return self.target.compute_logits(h).argmax(dim=-1)  # type: ignore[operator]
        best = self.lm_head(h).argmax(dim=-1)
        return best + self.d2t[best]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if len(kv_caches) != 1:
            raise ValueError(f"an EAGLE head has one layer, got {len(kv_caches)} KV caches")
        self.layer.self_attn.attn.kv_cache = kv_caches[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The published names (``fc``, ``layers.0.*`` / ``midlayer.*``, ``norm``,
        ``lm_head``, ``d2t``, ``embed_tokens``); ValueError naming a tensor that fits
        nothing, and listing parameters the checkpoint did not provide."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "t2d" or "rotary_emb" in name:
                continue
            if self.method == "eagle" and (name.startswith(("embed_tokens.", "lm_head."))
                                           or name.endswith("input_layernorm.weight")):
                continue  # shared with the target / skipped (as in vLLM)
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.long))
                continue
            name = name.replace("midlayer.", "layers.0.").replace("layers.0.", "layer.")
            target, shard = LlamaForCausalLM.weight_target(self, name)  # type: ignore
            param = params.get(target)
            if param is None:
                raise _err(f"{self.method} head tensor {name!r} matches no parameter")
            load_weight(param, tensor, *shard)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise _err(f"the {self.method} head checkpoint lacks {', '.join(missing[:5])}")


def load_eagle_head(model_config: Any, method: str, target: nn.Module,
                    device: torch.device, backend: AttentionBackend) -> EagleHead:
    """The head of ``model_config`` (its ``ModelConfig``: path, dtype, load format) for
    ``target``, on ``device``, weights loaded (or dummy-initialised)."""
    from pagedllm.models.loader import _DTYPES, _default_dtype, _init_dummy

    dummy = model_config.load_format == "dummy"
    shapes = {} if dummy else checkpoint_shapes(model_config.resolved.directory)
    with _default_dtype(_DTYPES[model_config.dtype]), torch.device(device):
        head = EagleHead(model_config.hf_config, backend, target, method,
                         fc_bias="fc.bias" in shapes,
                         own_embed=method == "eagle3" and "embed_tokens.weight" in shapes,
                         max_positions=int(model_config.max_model_len))
    if dummy:
        _init_dummy(head, device, int(model_config.seed), model_config.dummy_init)
    else:
        head.load_weights(head_weights(model_config.resolved.directory))
    return head.eval()


def enable_aux_states(target: nn.Module, head_config: Any, max_tokens: int) -> None:
    """Make ``target`` (a Llama-family model: ``target.model`` is a ``LlamaModel``)
    record, for EAGLE-3, the residual stream entering its aux layers into a static
    ``[max_tokens, 3 * hidden]`` buffer on every forward."""
    inner = getattr(target, "model", None)
    if not hasattr(inner, "aux_layers"):
        raise _err(f"eagle3 needs a Llama-family target, got {type(target).__name__}")
    layers: dict[int, list[int]] = {}
    for j, i in enumerate(aux_layer_ids(head_config, len(inner.layers))):
        layers.setdefault(i, []).append(j)
    h = int(target.config.hidden_size)
    w = next(target.parameters())
    inner.aux_buffer = torch.zeros(max_tokens, 3 * h, dtype=w.dtype, device=w.device)
    inner.aux_layers = layers
