"""Map a Hugging Face config's ``architectures`` to our model class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pagedllm.models.bert import BertModel, XLMRobertaModel
from pagedllm.models.bert_classifier import (
    BertForSequenceClassification,
    XLMRobertaForSequenceClassification,
)
from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedllm.models.llava import LlavaForConditionalGeneration
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM


@dataclass(frozen=True)
class ArchitectureInfo:
    """What an architecture supports, as listed in ``docs/models.md``.

    ``quantization``: which layers take the ``--quantization`` method (every linear
    layer; MoE experts only with methods that provide ``get_moe_method``).
    ``tensor_parallel``: the layers are tensor-parallel shaped (column/row sharded, MoE
    experts by their intermediate dimension); ``prefix_caching`` and ``cuda_graphs``: the
    engine features that apply unchanged.  ``attention``: the attention kinds its layers
    use (``attention/kinds.py``), all served by the torch and Triton backends.
    ``tasks``: what it serves natively -- ``generate`` (a decoder: ``runner="generate"``,
    and ``embed`` with ``runner="pooling"``, last-token pooling) or pooling tasks only
    (``embed``: an encoder; ``classify``/``score``: a cross-encoder), which select
    ``runner="pooling"`` automatically.  ``pipeline_parallel``: the layers split into
    stages (tested end to end on Llama; the decoders share its stage split)."""

    cls: type[nn.Module]
    family: str
    attention: str = "full"
    moe: bool = False
    quantization: str = "linear layers"
    tensor_parallel: bool = True
    prefix_caching: bool = True
    cuda_graphs: bool = True
    tasks: tuple[str, ...] = ("generate",)
    pipeline_parallel: bool = True

    @property
    def is_pooling_only(self) -> bool:
        return "generate" not in self.tasks


_ENCODER = dict(attention="bidirectional (no KV cache)", tensor_parallel=False,
                prefix_caching=False, cuda_graphs=False, pipeline_parallel=False)
_MOE_QUANT = ("linear layers; experts: FP8 (`--quantization fp8`; HF FP8 and "
              "compressed-tensors FP8 checkpoints, block-wise included); others refused")
_MLA = "multi-head latent (MLA; latent KV cache)"
_MLA_QUANT = _MOE_QUANT + "; MLA reads `kv_b_proj` dequantised"

ARCHITECTURES: dict[str, ArchitectureInfo] = {
    "LlamaForCausalLM": ArchitectureInfo(LlamaForCausalLM, "Llama 2/3, SmolLM2"),
    "MistralForCausalLM": ArchitectureInfo(MistralForCausalLM, "Mistral",
                                           "full or sliding window"),
    "Qwen2ForCausalLM": ArchitectureInfo(Qwen2ForCausalLM, "Qwen2, Qwen2.5",
                                         "full or sliding window (layer_types)"),
    "Qwen3ForCausalLM": ArchitectureInfo(Qwen3ForCausalLM, "Qwen3"),
    "MixtralForCausalLM": ArchitectureInfo(MixtralForCausalLM, "Mixtral 8x7B / 8x22B",
                                           "full or sliding window", moe=True,
                                           quantization=_MOE_QUANT),
    "Qwen2MoeForCausalLM": ArchitectureInfo(Qwen2MoeForCausalLM, "Qwen1.5-MoE, Qwen2-MoE",
                                            moe=True, quantization=_MOE_QUANT),
    "Qwen3MoeForCausalLM": ArchitectureInfo(Qwen3MoeForCausalLM, "Qwen3-30B-A3B, 235B-A22B",
                                            moe=True, quantization=_MOE_QUANT),
    "Phi3ForCausalLM": ArchitectureInfo(Phi3ForCausalLM, "Phi-3, Phi-3.5, Phi-4",
                                        "full or sliding window"),
    "DeepseekV2ForCausalLM": ArchitectureInfo(
        DeepseekV2ForCausalLM, "DeepSeek-V2, V2-Lite", _MLA, moe=True,
        quantization=_MLA_QUANT, cuda_graphs=False),
    "DeepseekV3ForCausalLM": ArchitectureInfo(
        DeepseekV3ForCausalLM, "DeepSeek-V3, R1, Kimi-K2, Moonlight", _MLA, moe=True,
        quantization=_MLA_QUANT, cuda_graphs=False),
    "Gemma2ForCausalLM": ArchitectureInfo(Gemma2ForCausalLM, "Gemma 2",
                                          "sliding/global alternating, logit soft-cap"),
    "Gemma3ForCausalLM": ArchitectureInfo(Gemma3ForCausalLM, "Gemma 3 (text)",
                                          "5 sliding : 1 global"),
    "Gemma3ForConditionalGeneration": ArchitectureInfo(
        Gemma3ForConditionalGeneration,
        "Gemma 3 (SigLIP + pooling projector + Gemma 3 decoder); images in",
        "5 sliding : 1 global; an image's tokens attend to their whole image",
        quantization="decoder linear layers (tower unquantised)", tensor_parallel=False,
        pipeline_parallel=False),
    "LlavaForConditionalGeneration": ArchitectureInfo(
        LlavaForConditionalGeneration,
        "LLaVA-1.5 / LLaVA-style (CLIP or SigLIP tower + projector + Llama, Mistral, "
        "Qwen2/3); images in", quantization="decoder linear layers (tower unquantised)",
        tensor_parallel=False, pipeline_parallel=False),
    "Qwen2VLForConditionalGeneration": ArchitectureInfo(
        Qwen2VLForConditionalGeneration,
        "Qwen2-VL (dynamic-resolution ViT + Qwen2 with M-RoPE); images in",
        quantization="decoder linear layers (tower unquantised)", tensor_parallel=False,
        pipeline_parallel=False),
    "Qwen2_5_VLForConditionalGeneration": ArchitectureInfo(
        Qwen2_5_VLForConditionalGeneration,
        "Qwen2.5-VL (window-attention ViT + Qwen2 with M-RoPE); images in",
        quantization="decoder linear layers (tower unquantised)", tensor_parallel=False,
        pipeline_parallel=False),
    "BertModel": ArchitectureInfo(BertModel, "BERT, BGE (v1.5), E5 (v2), MiniLM embedders",
                                  tasks=("embed",), **_ENCODER),  # type: ignore[arg-type]
    "XLMRobertaModel": ArchitectureInfo(XLMRobertaModel, "XLM-R, multilingual-E5, BGE-M3",
                                        tasks=("embed",), **_ENCODER),  # type: ignore[arg-type]
    "BertForSequenceClassification": ArchitectureInfo(
        BertForSequenceClassification, "BERT cross-encoders (ms-marco MiniLM rerankers)",
        tasks=("classify", "score"), **_ENCODER),  # type: ignore[arg-type]
    "XLMRobertaForSequenceClassification": ArchitectureInfo(
        XLMRobertaForSequenceClassification, "BGE-reranker (v2-m3, base, large)",
        tasks=("classify", "score"), **_ENCODER),  # type: ignore[arg-type]
}
MODEL_REGISTRY: dict[str, type[nn.Module]] = {a: i.cls for a, i in ARCHITECTURES.items()}

# Configs built from GGUF by transformers carry no `architectures`; fall back on model_type.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def task_summary(info: ArchitectureInfo) -> str:
    """The tasks column: a decoder also embeds under ``--runner pooling``."""
    if info.is_pooling_only:
        return ", ".join(info.tasks)
    return "generate; embed (`--runner pooling`)"


def architectures_table() -> str:
    """The Markdown table of ``docs/models.md`` (and ``pagedllm models``): one row per
    architecture."""
    rows = ["| Architecture | Models | Tasks | Attention | MoE | Quantisation | TP | PP "
            "| Prefix caching | CUDA graphs |", "|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for arch in supported_architectures():
        i = ARCHITECTURES[arch]
        rows.append(f"| `{arch}` | {i.family} | {task_summary(i)} | {i.attention} | "
                    f"{yes[i.moe]} | {i.quantization} | {yes[i.tensor_parallel]} | "
                    f"{yes[i.pipeline_parallel]} | {yes[i.prefix_caching]} | "
                    f"{yes[i.cuda_graphs]} |")
    return "\n".join(rows)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for ``hf_config``; ``ValueError`` naming ``architectures`` otherwise."""
    return ARCHITECTURES[get_architecture(hf_config)].cls


def get_architecture(hf_config: Any) -> str:
    """The registry key for ``hf_config``; ``ValueError`` naming ``architectures``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch
    if not archs:
        fallback = _MODEL_TYPES.get(getattr(hf_config, "model_type", None) or "")
        if fallback:
            return fallback
    raise ValueError(
        f"architectures: {archs or '(none)'} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}")
