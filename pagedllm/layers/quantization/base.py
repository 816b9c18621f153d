"""The quantisation-method interface of the linear layer (vLLM's ``QuantizeMethodBase``
idea, gpt-fast's module swap).

```
  QuantizationConfig  one per model: parsed from config.json's quantization_config,
        │             a GGUF file, or quantization="..." (quantise at load)
        │ get_linear_method(layer, prefix)       prefix = the layer's HF module name,
        ▼                                        e.g. "model.layers.3.self_attn.qkv_proj"
  LinearMethodBase    one per layer (may be shared): owns the layer's weight storage
        create_weights(layer, ...)     register parameters (shapes, dtypes, scales, packing)
        process_weights_after_loading  optional repack / quantise once every shard is in
        apply(layer, x, bias)          y = x W^T + b
```

Parameters a method registers are sharded for tensor parallelism by the layer's generic
``weight_loader`` from attributes set on each parameter (``set_weight_attrs``):

* ``output_dim`` / ``input_dim``: which tensor dim holds output / input features (None:
  the tensor is replicated, e.g. a per-tensor scale);
* ``packed_dim`` and ``packed_factor``: several logical elements per stored element along
  that dim (eight int4 in an int32), so shard offsets divide by the factor;
* ``per_shard``: a small tensor with one entry per fused shard (q, k, v or gate, up),
  e.g. per-tensor scales of a fused layer: shard i's checkpoint value goes to entry i;
* ``weight_loader``: a method may set its own loader on a parameter; it then receives
  ``(param, loaded, shard_id)`` and the layer's generic loader is not used.

The shard size along ``input_dim`` is always the parameter's own size on that dim, so
grouped scales (``[out, in / group]``) shard with the weight they scale.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

# ``layer`` below is a ``layers.linear.LinearBase`` (typed as nn.Module: the linear layer
# imports this interface, not the other way round).
LinearBase = nn.Module


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach sharding/loading attributes (see the module doc) to ``param``."""
    for k, v in attrs.items():
        setattr(param, k, v)


def kernel_label(method: Any, device: str) -> str:
    """What an integer method runs, for the start-up log: ``CUDA: <method.cuda_kernel>``
    or ``CPU: <method.cpu_kernel()>`` (the methods that define both)."""
    return f"CUDA: {method.cuda_kernel}" if device == "cuda" else f"CPU: {method.cpu_kernel()}"


class LinearMethodBase(ABC):
    """How one linear layer stores its weight and computes ``x W^T + b``.

    Contract: ``create_weights`` registers every parameter the checkpoint provides under
    the checkpoint's own suffix (``weight``, ``weight_scale``, ``qweight``, ...), on the
    ambient device, with the sharding attributes above; ``apply`` takes ``x`` in the
    model's dtype ``[T, in_per_partition]`` and returns ``[T, out_per_partition]`` in that
    dtype, without a device->host sync (it runs inside CUDA graphs)."""

    @abstractmethod
    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        """Register the layer's weight parameters on ``layer``.
        ``output_partition_sizes``: this rank's rows of each fused shard (one entry for
        an unfused layer)."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027
        """Repack or quantise once every shard is loaded (and after dummy init)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``."""

    def rms_norm_input(self, layer: LinearBase, x: torch.Tensor,
                       residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The RMSNorm whose output ``layer`` reads next (``layers/norm.RMSNorm`` linked
        by ``layers/norm.link_norms``), with part of this method's work on that output
        done in the same launch; the RMSNorm's result, or None where this method does not
        fuse (the norm then runs on its own).  A method that fuses keeps its part for
        :meth:`apply` of that very output tensor (any other input is processed as
        usual), so a model that does not fit the pattern stays correct."""
        return None

    def dummy_init(self, layer: LinearBase, generator: torch.Generator,  # noqa: B027
                   init: str) -> bool:
        """Fill the layer's weights for ``load_format="dummy"``; return False to let the
        loader fill its floating-point parameters as for an unquantised layer (then
        ``process_weights_after_loading`` runs as after a real load)."""
        return False

    def int4_segments(self, layer: LinearBase) -> list[list[Any]] | None:
        """The layer's weight as packed int4 parts (``int4pack.PackedInt4``) that fused
        CPU paths multiply themselves (``models/cpu_decode_stack.py``): segments concatenated
        along the output dimension, each the sum of its parts; None when it is stored
        any other way, or when ``apply`` does more than ``sum_p x W_p^T`` per segment
        (an input permutation, say)."""
        return None

    def weight_bytes(self, layer: LinearBase) -> int:
        """Bytes this layer's weights occupy (for the start-up log)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


class EmbeddingMethodBase(ABC):
    """How a token embedding (and the LM head that reads the same kind of table) stores
    its ``[vocab, hidden]`` table.  ``create_weights`` registers ``weight`` (with its
    ``weight_loader``); a tied head calls ``logits`` on the embedding's own storage."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, params_dtype: torch.dtype) -> None:
        """Register the table's parameters on ``layer`` (a ``VocabParallelEmbedding``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repack once the table is loaded."""

    @abstractmethod
    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """``[T] long -> [T, hidden]`` in the model dtype."""

    @abstractmethod
    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in ``hidden``'s dtype."""


class QuantizationConfig(ABC):
    """One model's quantisation: which layers use which ``LinearMethodBase``."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> QuantizationConfig:
        """Build from the transformers config (its ``quantization_config``, if any) and
        our ``ModelConfig``; ``ValueError`` naming what is unsupported."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the linear layer named ``prefix``; None keeps it unquantised
        (layers the checkpoint lists as ignored, lm_head, ...)."""

    def get_embedding_method(self, layer: nn.Module,
                             prefix: str) -> EmbeddingMethodBase | None:
        """The method for the embedding or LM head named ``prefix``
        (``model.embed_tokens``, ``lm_head``); None (the default) keeps it in the model
        dtype."""
        return None

    def check_device(self, device: str, dtype: str) -> None:  # noqa: B027
        """``ValueError`` naming ``quantization`` when this method cannot run on
        ``device`` in ``dtype`` (e.g. FP8 GEMMs on a GPU without FP8)."""

    def describe(self) -> str:
        """One line for the start-up log (format, bits, group size)."""
        return self.name

    def describe_kernels(self, device: torch.device) -> str | None:
        """What runs this method's layers on ``device``, for the start-up log (None:
        nothing to add)."""
        return None
