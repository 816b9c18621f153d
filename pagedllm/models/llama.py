"""Llama (and Mistral without sliding window): the decoder every other model here extends.

Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are the same graph with flags, see
``LlamaAttention``.  One step's data path::

  ids -> embed -> [ norm(+res) -> qkv -> (qk-norm) -> rope -> paged attn -> o
                    -> norm(+res) -> gate_up -> silu*mul -> down ] x L -> norm -> hidden

With ``last_only`` the last layer keeps, after its attention, only each request's last
token: the other rows' KV is already written, and nothing downstream reads their hidden
states, so the last o_proj, MLP and final norm run on ``num_reqs`` rows, not on every
prompt token (about 1/L of a prompt's GEMM work).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kinds import AttentionKind, layer_sliding_windows
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import QKNorm, RopeInputs
from pagedllm.distributed.parallel_state import current_parallel_state, layer_range
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    gemv_applies,
    load_weight,
)
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.cpu_decode_stack import DecodeStack, StackLayer


def attention_kind(config: Any, layer: int) -> AttentionKind:
    """Layer ``layer``'s attention as transformers runs it: with ``layer_types`` (Qwen2,
    Gemma), a sliding window on ``"sliding_attention"`` layers; without (Mistral,
    Mixtral, Phi-3), on every layer when ``sliding_window`` is set."""
    return AttentionKind(sliding_window=layer_sliding_windows(config)[layer])


def layer_index(prefix: str) -> int:
    """The layer number in an HF module name (``model.layers.3.self_attn`` -> 3)."""
    return int(prefix.split("layers.")[1].split(".")[0]) if "layers." in prefix else 0


def head_dim_of(config: Any) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate] * 2, bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate, hidden, bias,
                                           quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gemv_applies(gate_up, self.down_proj):
            # Batch-1 decode: the activation runs inside down_proj's GEMV.
            return self.down_proj.forward_gated(gate_up)
        return self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV.  ``qkv_bias``/``o_bias`` cover Llama's
    ``attention_bias`` and Qwen2's bias-on-qkv-only; ``qk_norm`` adds Qwen3's per-head
    RMSNorm on q and k (applied before RoPE)."""

    def __init__(self, config: Any, backend: AttentionBackend, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads,
                                          self.num_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        # From here on heads are this rank's (all of them without tensor parallelism);
        # o_proj's input follows the QKV head partition.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, \
            self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            self.qkv_proj.total_num_heads * self.head_dim, config.hidden_size, bias=o_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
            input_sizes=[n * self.head_dim for _, n, _, _ in self.qkv_proj.partition])
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, backend,
                              attention_kind(config, layer_index(prefix)))

    @functools.cached_property
    def _qk_norm(self) -> QKNorm | None:
        """The per-head norms handed to a backend that rotates (built on first use: Gemma
        sets its own norm modules after this constructor)."""
        if not self.qk_norm:
            return None
        return QKNorm(self.q_norm, self.k_norm, isinstance(self.q_norm, GemmaRMSNorm))

    def _fused_qkv_rope(self, x: torch.Tensor, rope: RopeInputs) -> bool:
        """Whether this step's QKV runs as the batch-1 GEMV with rotary and the KV write
        fused in.  Like ``gemv_applies`` it depends only on shapes and types, never on
        data, so graph capture and eager runs of one batch size take the same path."""
        if self.qk_norm or not self.attn.backend.fuses_rope \
                or not gemv_applies(x, self.qkv_proj) \
                or self.attn.kv_cache.dtype == torch.float8_e4m3fn:  # it stores no fp8
            return False
        from pagedllm.kernels.gemv_rope import qkv_rope_supported

        return qkv_rope_supported(self.head_dim, rope.cos_sin_cache.shape[-1])

    def forward(self, rope: RopeInputs, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rope``: this step's inputs from ``RotaryEmbedding.inputs``.  ``rows``: the
        token rows to keep after attention (the output has one row per index, in that
        order); None keeps every row.  q, k, v and the KV write always cover every row."""
        t = x.shape[0]
        meta = self.attn.group_meta(meta)  # its KV cache group's tables and slots
        if self._fused_qkv_rope(x, rope):
            # Batch-1 decode: one kernel projects, rotates q and k and writes k/v into
            # the cache (kernels/gemv_rope.py); attention then only reads.
            from pagedllm.kernels.gemv_rope import gemv_qkv_rope

            lora = self.qkv_proj.lora  # an adapter's delta joins before the rotation
            # (the shrink runs first; the GEMV adds the expand in its epilogue)
            qkv = gemv_qkv_rope(
                x, self.qkv_proj.weight, self.qkv_proj.bias, rope.positions,
                rope.cos_sin_cache, self.attn.kv_cache, meta.slot_mapping,
                num_heads=self.qkv_proj.num_heads, num_kv_heads=self.qkv_proj.num_kv_heads,
                head_dim=self.head_dim, lora=lora.gemv_lora(x) if lora is not None else None)
            return self._out(self.attn.attend_cached(qkv[:, :self.q_size], meta), rows)
        qkv = self.qkv_proj(x)
        q_end = self.q_size
        k_end = q_end + self.kv_size
        v = qkv[:, k_end:]
        if self.attn.backend.fuses_rope:
            # One kernel (norms each head,) rotates and writes the KV cache.
            return self._out(self.attn(qkv[:, :q_end], qkv[:, q_end:k_end], v, meta, rope,
                                       self._qk_norm), rows)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :q_end].view(t, -1, self.head_dim))
            k = self.k_norm(qkv[:, q_end:k_end].view(t, -1, self.head_dim))
        else:
            q, k = qkv[:, :q_end], qkv[:, q_end:k_end]
        if self.qk_norm:
            q, k = rope.rotate(q), rope.rotate(k)
        else:
            # q and k are adjacent in the fused output: rotate both heads-blocks in one
            # pass over a [T, Hq + Hk, D] view, then take views of the result.
            qk = rope.rotate(qkv[:, :k_end].view(t, -1, self.head_dim))
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self._out(self.attn(q, k, v, meta), rows)

    def _out(self, attn_out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None:
            attn_out = attn_out.index_select(0, rows)
        return self.o_proj(attn_out)


def make_llama_mlp(config: Any, layer: int, quant_config: QuantizationConfig | None,
                   prefix: str) -> nn.Module:
    """The dense SwiGLU MLP of every Llama layer (MoE models pass their own factory)."""
    return LlamaMLP(config.hidden_size, config.intermediate_size,
                    bool(getattr(config, "mlp_bias", False)), quant_config, prefix)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: LlamaAttention,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp if mlp is not None else make_llama_mlp(config, 0, quant_config,
                                                              f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual convention: the residual stream is carried separately and
        added inside the next norm, so each layer returns ``(mlp_out, residual)``.
        ``rows``: keep only those token rows from the attention output on (see
        ``LlamaAttention.forward``)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)  # type: ignore[assignment]
        else:
            hidden, residual = self.input_layernorm(hidden, residual)  # type: ignore[misc]
        hidden = self.self_attn(rope, hidden, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)  # type: ignore
        return self.mlp(hidden), residual


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage owns (keeps layer indices global)."""


class LlamaModel(nn.Module):
    """The decoder stack of this rank's pipeline stage (``distributed/parallel_state``):
    decoder layers ``[start_layer, end_layer)`` (others are ``PPMissingLayer``), the
    embedding on the first stage, the final norm on the last.  A stage that is not the
    last returns ``(hidden, residual)`` for the next one, which passes them back in as
    ``intermediate``."""

    def __init__(self, config: Any, backend: AttentionBackend, make_attention: Any,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "model", make_mlp: Any = make_llama_mlp) -> None:
        super().__init__()
        pp = current_parallel_state().pp
        self.is_first, self.is_last = pp.is_first, pp.is_last
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = layer_range(n, pp.world_size, pp.rank_in_group)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # A tied last stage keeps the embedding too: it is its LM head.
        self.embed_tokens: nn.Module = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens") if self.is_first or (
            tied and self.is_last) else PPMissingLayer()
        # One cos/sin table for all layers, gathered once per step in forward().
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, make_attention(config, backend, quant_config,
                                       f"{prefix}.layers.{i}.self_attn"),
                quant_config, f"{prefix}.layers.{i}",
                make_mlp(config, i, quant_config, f"{prefix}.layers.{i}.mlp"))
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(n))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps) \
            if self.is_last else PPMissingLayer()
        # EAGLE-3 (worker/spec_decode/eagle.py) reads the residual stream entering some layers:
        # layer -> its column slots in ``aux_buffer`` ([rows, slots * hidden], set at load
        # with the layers; a static buffer, so CUDA graphs replay the copies).  Empty
        # and None otherwise: the loop below tests one dict.
        self.aux_layers: dict[int, list[int]] = {}
        self.aux_buffer: torch.Tensor | None = None
        # The CPU decode stack (models/cpu_decode_stack.py): planned at the first CPU step
        # (weights packed, caches bound), False when the layers do not fit it; reset
        # when the caches are rebound.
        self.cpu_stack: DecodeStack | None | bool = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_only: bool = False,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        residual: torch.Tensor | None = None
        if inputs_embeds is not None:  # a step with images (models/llava.py)
            hidden = inputs_embeds
        elif intermediate is None:
            hidden = self.embed_tokens(input_ids)
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.inputs(positions, hidden.dtype)
        # A decode-only step (max_query_len 1) has one row per request already.
        rows = meta.query_start_loc[1:] - 1 if last_only and meta.max_query_len > 1 \
            else None
        last = len(self.layers) - 1
        stack = self._cpu_stack(hidden, meta)
        if stack is not None:  # a CPU decode step: every layer in one C call
            if meta.kv_ready is not None:  # (host-tier loads: on the CPU, landed already)
                for i in range(self.start_layer, self.end_layer):
                    meta.kv_ready(self.layers[i].self_attn.attn.kv_cache)
            hidden, residual = stack.run(hidden, residual, rope, meta)
        else:
            for i in range(self.start_layer, self.end_layer):
                if i in self.aux_layers:
                    self._record_aux(i, hidden, residual)
                hidden, residual = self.layers[i](rope, hidden, residual, meta,
                                                  rows if i == last else None)
        if not self.is_last:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)  # type: ignore[misc]
        return hidden

    def _cpu_stack(self, hidden: torch.Tensor, meta: AttentionMetadata) -> DecodeStack | None:
        """The CPU decode stack when it takes this step (its ``applies``), else None."""
        if hidden.is_cuda or self.aux_layers:
            return None
        if self.cpu_stack is None:
            self.cpu_stack = self._plan_cpu_stack() or False
        stack = self.cpu_stack
        return stack if stack and stack.applies(hidden, meta) else None

    def _plan_cpu_stack(self) -> DecodeStack | None:
        """The stack over this stage's layers, when each is exactly the plain Llama layer
        it computes: this class's attention and MLP without biases, q/k norms or LoRA,
        packed int4 projections, the CPU backend, one KV cache group."""
        layers = [self.layers[i] for i in range(self.start_layer, self.end_layer)]
        if not layers:
            return None
        plain = []
        for lay in layers:
            attn, mlp = lay.self_attn, lay.mlp
            if type(lay) is not LlamaDecoderLayer or type(attn) is not LlamaAttention \
                    or type(mlp) is not LlamaMLP or attn.qk_norm \
                    or attn.attn.backend.name != "cpu" or attn.attn.kv_group \
                    or attn.attn.calculate_kv_scales \
                    or lay.input_layernorm.lora_next is not None \
                    or lay.post_attention_layernorm.lora_next is not None:
                return None
            segs = [attn.qkv_proj.int4_segments, attn.o_proj.int4_segments,
                    mlp.gate_up_proj.int4_segments, mlp.down_proj.int4_segments]
            if any(s is None for s in segs) or attn.attn.kv_cache is None:
                return None
            kind = attn.attn.kind
            plain.append(StackLayer(
                lay.input_layernorm.weight.data, lay.post_attention_layernorm.weight.data,
                *segs, attn.attn.kv_cache, attn.attn.scale,  # type: ignore[arg-type]
                kind.sliding_window or 0, kind.logits_soft_cap or 0.0))
        a0, m0 = layers[0].self_attn, layers[0].mlp
        return DecodeStack.build(plain, a0.qkv_proj.input_size, a0.num_heads,
                                 a0.num_kv_heads, a0.head_dim,
                                 m0.down_proj.in_per_partition,
                                 layers[0].input_layernorm.eps)

    def _record_aux(self, layer: int, hidden: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
        """Write the residual stream entering ``layer`` (vLLM's ``hidden + residual``)
        into its slots of ``aux_buffer``, rows ``[0, T)``."""
        buf = self.aux_buffer
        assert buf is not None
        x = hidden if residual is None else hidden + residual
        h = x.shape[-1]
        for j in self.aux_layers[layer]:
            buf[:x.shape[0], j * h:(j + 1) * h].copy_(x)


class LlamaForCausalLM(nn.Module):
    """The model interface the model runner uses (identical for every architecture):

    * ``forward(input_ids [T] long, positions [T] long, meta) -> hidden [T, hidden]``;
      with ``last_only=True``, ``[meta.num_reqs, hidden]``: row i is request i's last
      token (``meta.query_start_loc[i + 1] - 1``), the only rows logits are sampled from
    * ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` in the model's dtype (only the
      rows given)
    * ``bind_kv_caches(list of per-layer caches, layer order)``
    * ``load_weights(iterable of (HF name, tensor))``
    * ``get_input_embeddings(input_ids [T]) -> [T, hidden]``; ``forward(...,
      inputs_embeds=[T, hidden])`` runs the decoder on those instead of the ids' own
      embeddings (a step with images; the runner's text steps never pass it)

    A vision-language model (``models/llava.py``) adds ``embed_multimodal(tensors) ->
    one [placeholder tokens, hidden] tensor per image`` (its inputs carry a leading image
    dimension) and marks itself with ``supports_multimodal = True``.

    ``quant_config`` (``layers/quantization/``) picks each linear layer's weight format by
    its HF module name, and may store the embedding and lm_head compactly too.
    """

    # (fused parameter, checkpoint name, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.check_config(hf_config)
        self.model = LlamaModel(hf_config, backend, self.make_attention, quant_config,
                                make_mlp=self.make_mlp)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head: nn.Module = PPMissingLayer()
        if self.model.is_last:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          quant_config=None if self.tied else quant_config,
                                          prefix="lm_head")
            if self.tied:
                self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def check_config(config: Any) -> None:
        """Reject a config this class cannot run exactly (``ValueError`` naming the
        field); every Llama-family config is runnable today."""

    @staticmethod
    def make_attention(config: Any, backend: AttentionBackend,
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> LlamaAttention:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, backend, qkv_bias=bias, o_bias=bias,
                              quant_config=quant_config, prefix=prefix)

    make_mlp = staticmethod(make_llama_mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, last_only: bool = False,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is None:  # the text path, unchanged
            return self.model(input_ids, positions, meta, last_only, intermediate)
        return self.model(input_ids, positions, meta, last_only, intermediate,
                          inputs_embeds)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        layers = self.model.layers[self.model.start_layer:self.model.end_layer]
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
        for layer, cache in zip(layers, kv_caches):
            layer.self_attn.attn.kv_cache = cache
        self.model.cpu_stack = None  # planned again with the new caches

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ``ValueError`` naming the tensor on an unknown
        name or a shape mismatch, and listing parameters the checkpoint did not provide."""
        self.model.cpu_stack = None  # its pointers would be the old weights'
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tied:
                continue  # the head is the embedding
            if self._on_other_stage(name):
                continue
            target, shard_args = self.weight_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            try:
                load_weight(param, tensor, *shard_args)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            loaded.add(target)
        missing = sorted(set(params) - loaded - ({"lm_head.weight"} if self.tied else set()))
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {shown}")


    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """``(parameter name, extra weight_loader args)`` of checkpoint tensor ``name``:
        q/k/v and gate/up go into their fused parameters with a shard id."""
        for fused, part, shard_id in self.stacked_params_mapping:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), (shard_id,)
        return name, ()

    def _on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage."""
        m = self.model
        if name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            return not m.start_layer <= i < m.end_layer
        if name.startswith("model.embed_tokens."):
            return isinstance(m.embed_tokens, PPMissingLayer)
        if name.startswith("model.norm."):
            return not m.is_last
        return name.startswith("lm_head.") and not m.is_last


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's graph; ``sliding_window`` (v0.1) windows every layer."""
