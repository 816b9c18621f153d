"""DeepSeek-V2 / V3 (and V2-Lite, Kimi-K2, Moonlight: the same graph): the Llama decoder
layer with multi-head latent attention (``layers/mla.py``) and, from layer
``first_k_dense_replace`` on, DeepSeekMoE MLPs (``models/deepseek_moe.py``).

```
 ids -> embed -> [ norm(+res) -> MLA (latent KV cache) -> norm(+res)
                   -> dense SwiGLU (layer < first_k_dense_replace) | DeepSeekMoE ] x L
               -> norm -> lm_head
```

The rotary table is over ``qk_rope_head_dim`` features, with YaRN's attention factor;
the MLA layer adds DeepSeek's ``mscale_all_dim`` correction to the softmax scale.  The KV
cache holds one ``kv_lora_rank + qk_rope_head_dim`` entry per token and layer
(``ModelConfig.kv_entries_per_token`` = 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.mla_torch import MLATorchBackend
from pagedllm.layers.mla import MultiHeadLatentAttention
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP


def _is_moe_layer(config: Any, layer: int) -> bool:
    """transformers' rule: every layer from ``first_k_dense_replace`` on is MoE."""
    return layer >= int(getattr(config, "first_k_dense_replace", 0) or 0) \
        and bool(getattr(config, "n_routed_experts", 0))


def make_deepseek_mlp(config: Any, layer: int, quant_config: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
    if not _is_moe_layer(config, layer):
        return LlamaMLP(config.hidden_size, config.intermediate_size,
                        bool(getattr(config, "mlp_bias", False)), quant_config, prefix)
    try:
        from pagedllm.models.deepseek_moe import DeepseekMoE
    except ImportError as e:
        raise ValueError(
            f"first_k_dense_replace: layer {layer} is a DeepSeekMoE layer, which needs "
            "pagedllm.models.deepseek_moe") from e
    return DeepseekMoE(config, quant_config, prefix)


def bind_mla_caches(layers: list[MultiHeadLatentAttention], kv_caches: list[Any]) -> None:
    """Bind each of ``layers`` its latent cache ``[1, blocks, block_size, 1, L + R]``
    (model dtype or fp8 e4m3: ``attention/mla_torch.py``); ``None`` unbinds.
    ``ValueError`` on a wrong count or shape, or another one-byte type."""
    if len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
    for layer, cache in zip(layers, kv_caches):
        if cache is None:  # unbound (the start-up profile's caches are dropped)
            layer.kv_cache = torch.empty(0)
            continue
        if cache.element_size() == 1 and cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"kv_cache_dtype: an MLA latent cache of {cache.dtype} is "
                             "not supported; use kv_cache_dtype='fp8' (e4m3) or 'auto'")
        want = (1, layer.kv_lora_rank + layer.rope_dim)
        if cache.dim() != 5 or (cache.shape[0], cache.shape[-1]) != want \
                or cache.shape[3] != 1:
            raise ValueError(f"MLA KV cache must be [1, blocks, block_size, 1, "
                             f"{want[1]}], got {list(cache.shape)}")
        layer.kv_cache = cache


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The model interface of ``LlamaForCausalLM`` over MLA layers.

    ``mla_backend`` (one per model, shared by its layers) is the MLA attention backend;
    the GQA ``backend`` the loader passes is not used by attention.  Checkpoint names are
    HF's: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``,
    ``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``; dense MLPs'
    ``gate_proj``/``up_proj`` load into ``gate_up_proj``."""

    stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    make_mlp = staticmethod(make_deepseek_mlp)
    # Every step replays CUDA graphs, chunk steps too: the MLA backend runs a graph's
    # steps in the absorbed form through the decode kernel, whose launch depends on host
    # ints only (``MLATorchBackend._graph_step``: no host plan).  That form's attention
    # work grows with a chunk's square, so chunk graphs stop at 1,024 tokens; larger
    # steps run eagerly, chunks in the expanded form (kernels/mla_prefill.py).
    cuda_graph_steps = "all"
    max_chunk_graph_tokens = 1024

    def __init__(self, hf_config: Any, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        # Set before nn.Module.__init__ runs the layer factories (a plain object, so the
        # attribute does not need the module's registries yet).
        self.mla_backend = MLATorchBackend()
        super().__init__(hf_config, backend, quant_config)
        # The rotary table covers qk_rope_head_dim features.  transformers 5.x sets the
        # config's head_dim to it, but a remote-code config.json (released checkpoints,
        # older transformers) has none, and Llama's default would be hidden / heads.
        self.model.rotary_emb = RotaryEmbedding(int(hf_config.qk_rope_head_dim),
                                                int(hf_config.max_position_embeddings),
                                                rope_parameters(hf_config))

    @staticmethod
    def check_config(config: Any) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(config, name, None):
                raise ValueError(f"{name}: DeepSeek MLA needs a positive {name}, got "
                                 f"{getattr(config, name, None)!r}")
        if int(config.qk_rope_head_dim) % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {config.qk_rope_head_dim}")

    def make_attention(self, config: Any, backend: AttentionBackend,  # type: ignore[override]
                       quant_config: QuantizationConfig | None = None,
                       prefix: str = "") -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(config, self.mla_backend, quant_config, prefix)

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """DeepSeekMoE tensors (routed and shared experts, router) map through
        ``deepseek_moe.deepseek_moe_weight_target``; the rest as Llama's (dense
        ``gate_proj``/``up_proj`` into ``gate_up_proj``, attention names unchanged)."""
        if ".mlp.experts." in name or ".mlp.shared_experts." in name or ".mlp.gate." in name:
            from pagedllm.models.deepseek_moe import deepseek_moe_weight_target

            hit = deepseek_moe_weight_target(name)
            if hit is not None:
                return hit
        return super().weight_target(name)

    def mla_layers(self) -> list[MultiHeadLatentAttention]:
        """This stage's MLA layers, in layer order."""
        return [m for m in self.modules() if isinstance(m, MultiHeadLatentAttention)]

    def set_mla_mode(self, mode: str) -> None:
        """Force every layer's attention form ("absorbed", "expanded") or "auto"."""
        for layer in self.mla_layers():
            layer.set_mode(mode)

    def bind_kv_caches(self, kv_caches: list[Any]) -> None:
        """Each MLA layer's latent cache (``bind_mla_caches``)."""
        bind_mla_caches(self.mla_layers(), kv_caches)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's graph; RoPE per ``rope_interleave``, sigmoid routing with
    ``e_score_correction_bias`` in its MoE layers."""
