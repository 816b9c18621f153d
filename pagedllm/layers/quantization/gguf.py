"""GGUF weights kept quantised: linear layers, the embedding and the LM head.

Chosen automatically for a GGUF file with quantised tensors (``resolve_quantization``);
``quantization="none"`` keeps the float32 dequantised path instead.  The loader
(``models/loader.py: iter_gguf(keep_quantized=True)``) hands each supported quantised
tensor over as its raw uint8 block bytes ``[rows, row_bytes]`` with a ``ggml_type``
attribute; float tensors come as before.  After loading, each tensor becomes

* int4 parts (``gguf_blocks.int4_parts``) packed for torch's int4 kernels
  (``int4pack.py``): Q4_0, Q4_1, Q4_K one part, Q8_0 and Q5_K two;
* a dense weight in the model dtype otherwise (Q6_K: its 16-value groups have no int4
  kernel; float tensors).

A fused layer (q/k/v, gate/up) whose shards have different types keeps one matmul per
run of alike shards and concatenates the outputs.  The embedding gathers its rows' codes
and dequantises them exactly (``gguf_blocks.exact_affine``: bitwise the float32
dequantised value); a tied LM head multiplies by the same packed parts, so the table is
stored once.  Linear outputs and logits are computed from bf16 activations (the int4
kernels' dtype, module doc of ``int4pack.py``) and returned in the model dtype.

On a VNNI or AVX2 CPU (``int4_vnni.py``) the products take the activations as ggml itself does
for these block types: quantised to int8 per 32 columns (ggml's Q8_0/Q8_1 blocks for
Q4_0/Q4_1/Q8_0, Q8_K for the K-quants), which runs about 1.6x the int16 path's speed
(int16 activations carry about 2^-16 of a block's largest value instead of 2^-8: the
perplexity change against the float32 dequantised model, +0.36% against -0.03%, is
measured in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization import gguf_blocks as gb
from pagedllm.layers.quantization import int4_vnni
from pagedllm.layers.quantization.base import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    set_weight_attrs,
)
from pagedllm.layers.quantization.int4pack import (
    PackedInt4,
    PackedInt8,
    cpu_kernel_available,
    gatherable,
    mm_parts,
    packable,
)

if TYPE_CHECKING:
    from pagedllm.layers.embedding import VocabParallelEmbedding
    from pagedllm.layers.linear import LinearBase

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16


# VNNI products of GGUF weights take int8 activations, as ggml's (module doc).  The
# int16 layout stays for the other int4 formats on the CPU; tests switch this to reach
# it through a GGUF file.
ACT8 = True


@dataclass
class _Shard:
    """One checkpoint tensor as loaded: raw blocks (``qtype`` quantised) or floats."""

    qtype: int
    data: torch.Tensor


def _take(store: dict[int, _Shard], idx: int, loaded: torch.Tensor, rows: int, cols: int,
          what: str) -> None:
    qtype = int(getattr(loaded, "ggml_type", 0))
    if loaded.shape[0] != rows:
        raise ValueError(f"shape mismatch for {what}: {rows} rows expected, checkpoint has "
                         f"{tuple(loaded.shape)}")
    if qtype in _FLOAT_TYPES and tuple(loaded.shape) != (rows, cols):
        raise ValueError(f"shape mismatch for {what}: expected {(rows, cols)}, checkpoint "
                         f"has {tuple(loaded.shape)}")
    store[idx] = _Shard(qtype, loaded)


def _kind(shard: _Shard) -> int:
    """Number of int4 parts of a shard's storage, 0 for a dense weight."""
    if shard.qtype in gb.INT4_TYPES:
        return 2 if shard.qtype in (gb.Q.Q8_0, gb.Q.Q5_K) else 1
    return 0


def _dense(shard: _Shard, k: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    if shard.qtype in _FLOAT_TYPES:
        return shard.data.to(dtype)
    return gb.dequantize(shard.data, shard.qtype, k, what).to(dtype)


def _register(module: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    module.register_buffer(name, t, persistent=False)
    return t


def _pack(module: nn.Module, name: str, shards: list[_Shard], k: int,
          device: torch.device, what: str) -> list[PackedInt4]:
    """Pack shards of one kind into int4 parts stacked along N (buffers on ``module``)."""
    per_shard = [gb.int4_parts(s.data, s.qtype, k, what) for s in shards]
    parts = []
    for j in range(len(per_shard[0])):
        v, scale, zero = (torch.cat([p[j][i] for p in per_shard]) for i in range(3))
        part = PackedInt4(v, scale, zero, gb.GROUP, device, act8=ACT8)
        _register(module, f"{name}_p{j}_packed", part.packed)
        _register(module, f"{name}_p{j}_scale_zero", part.scale_zero)
        parts.append(part)
    return parts


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer from GGUF tensors (module doc).  ``weight`` is a placeholder that
    takes the checkpoint tensors; the storage appears at ``process_weights_after_loading``."""

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        if layer.tp_size != 1:
            raise ValueError("quantization 'gguf' runs with tensor_parallel_size 1 only")
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": functools.partial(self._load, layer)})
        layer.register_parameter("weight", weight)
        layer.gguf_shards = {}  # type: ignore[assignment]
        layer.gguf_params_dtype = params_dtype  # type: ignore[assignment]

    def _load(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
              shard_id: int | str | None = None) -> None:
        idx = 0 if shard_id is None else layer._shard_index(shard_id)
        rows = layer.output_partition_sizes[idx]
        _take(layer.gguf_shards, idx, loaded, rows, layer.in_per_partition,  # type: ignore
              f"{layer.prefix} shard {shard_id}")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        store: dict[int, _Shard] = layer.gguf_shards  # type: ignore[assignment]
        n_shards = len(layer.output_partition_sizes)
        if sorted(store) != list(range(n_shards)):
            raise ValueError(f"{layer.prefix}: GGUF shards missing "
                             f"(got {sorted(store)} of {n_shards})")
        k, device = layer.in_per_partition, layer.weight.device
        shards = [store[i] for i in range(n_shards)]
        segments: list[tuple[int, list[PackedInt4] | torch.Tensor]] = []
        i = 0
        while i < n_shards:  # runs of alike shards share one matmul
            j = i
            while j + 1 < n_shards and _kind(shards[j + 1]) == _kind(shards[i]):
                j += 1
            run, name = shards[i:j + 1], f"gguf_seg{len(segments)}"
            rows = sum(s.data.shape[0] for s in run)
            if _kind(shards[i]) and packable(rows, k, device):
                segments.append((1, _pack(layer, name, run, k, device, layer.prefix)))
            else:
                w = torch.cat([_dense(s, k, layer.gguf_params_dtype, layer.prefix)  # type: ignore
                               for s in run]).to(device)
                segments.append((0, _register(layer, f"{name}_weight", w)))
            i = j + 1
        layer.gguf_segments = segments  # type: ignore[assignment]
        layer.gguf_types = [s.qtype for s in shards]  # type: ignore[assignment]
        layer.gguf_shards = {}  # type: ignore[assignment]

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        outs = [mm_parts(x, seg) if packed else F.linear(x, seg)  # type: ignore[arg-type]
                for packed, seg in layer.gguf_segments]  # type: ignore[attr-defined]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if bias is None else y + bias

    def int4_segments(self, layer: LinearBase) -> list[list[Any]] | None:
        segs = layer.gguf_segments  # type: ignore[attr-defined]
        return [seg for _, seg in segs] if all(packed for packed, _ in segs) else None

    def dummy_init(self, layer: LinearBase, generator: torch.Generator, init: str) -> bool:
        raise ValueError("quantization 'gguf' needs a GGUF checkpoint, not load_format "
                         "'dummy'")


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The token embedding (and, tied or not, the LM head) from a GGUF tensor."""

    def create_weights(self, layer: VocabParallelEmbedding, params_dtype: torch.dtype) -> None:
        if layer.tp_size != 1:
            raise ValueError("quantization 'gguf' runs with tensor_parallel_size 1 only")
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = functools.partial(self._load, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.gguf_shards = {}  # type: ignore[assignment]
        layer.gguf_params_dtype = params_dtype  # type: ignore[assignment]

    def _load(self, layer: VocabParallelEmbedding, param: nn.Parameter,
              loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        _take(layer.gguf_shards, 0, loaded, layer.vocab_size, layer.hidden_size,  # type: ignore
              "embedding")

    def process_weights_after_loading(self, layer: VocabParallelEmbedding) -> None:
        shard: _Shard | None = layer.gguf_shards.get(0)  # type: ignore[attr-defined]
        if shard is None:
            raise ValueError("GGUF embedding tensor missing")
        k, device = layer.hidden_size, layer.weight.device
        layer.gguf_types = [shard.qtype]  # type: ignore[assignment]
        layer.gguf_parts = None  # type: ignore[assignment]
        n = layer.vocab_size
        if shard.qtype == gb.Q.Q8_0 and device.type == "cpu" and n % 16 == 0 \
                and k % 32 == 0 and int4_vnni.available():
            # One byte per weight for the VNNI kernel: half the instructions of two
            # int4 parts, the same bytes (int4pack.PackedInt8).
            u, d = gb.q8_0_codes(shard.data, k, "embedding")
            part = PackedInt8(u, d, torch.zeros_like(d), gb.GROUP, act8=ACT8)
            _register(layer, "gguf_p0_packed", part.packed)
            _register(layer, "gguf_p0_scale_zero", part.scale_zero)
            layer.gguf_parts = [part]  # type: ignore[assignment]
        elif _kind(shard) and packable(n, k, device) and gatherable(n, device):
            layer.gguf_parts = _pack(layer, "gguf", [shard], k, device, "embedding")
        if layer.gguf_parts is not None:  # type: ignore[attr-defined]
            a, b, off = gb.exact_affine(shard.data, shard.qtype, k, "embedding")
            layer.gguf_affine = (_register(layer, "gguf_a", a),  # type: ignore[assignment]
                                 None if b is None else _register(layer, "gguf_b", b), off)
        else:  # a dense table (also on CUDA, where the packed layout is opaque)
            w = _dense(shard, k, layer.gguf_params_dtype, "embedding")  # type: ignore
            layer.gguf_dense = _register(layer, "gguf_weight", w.to(device))
            if _kind(shard) and packable(n, k, device):  # the head multiplies packed parts
                layer.gguf_parts = _pack(layer, "gguf", [shard], k, device, "embedding")
        layer.gguf_shards = {}  # type: ignore[assignment]

    def embed(self, layer: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
        dtype = layer.gguf_params_dtype  # type: ignore[attr-defined]
        if hasattr(layer, "gguf_dense"):
            return F.embedding(ids, layer.gguf_dense)  # type: ignore[arg-type]
        parts: list[PackedInt4] = layer.gguf_parts  # type: ignore[assignment]
        a, b, off = layer.gguf_affine  # type: ignore[attr-defined]
        code = gb.code_from_parts([p.gather_rows(ids) for p in parts], layer.gguf_types[0])
        t = ids.shape[0]
        c = (code - off).float().view(t, -1, gb.GROUP)
        w = a[ids].unsqueeze(-1) * c
        if b is not None:
            w = w + b[ids].unsqueeze(-1)
        return w.view(t, layer.hidden_size).to(dtype)

    def logits(self, layer: VocabParallelEmbedding, hidden: torch.Tensor) -> torch.Tensor:
        if layer.gguf_parts is not None:  # type: ignore[attr-defined]
            return mm_parts(hidden, layer.gguf_parts)  # type: ignore[attr-defined]
        return F.linear(hidden, layer.gguf_dense.to(hidden.dtype))  # type: ignore


class GGUFConfig(QuantizationConfig):
    """Every linear layer, the embedding and the head take GGUF tensors (module doc)."""

    name = "gguf"
    # models/loader.py hands over raw quantised blocks instead of dequantising.
    gguf_raw = True

    def __init__(self, type_counts: Counter[str], quant_bytes: int) -> None:
        self.type_counts = type_counts
        self.quant_bytes = quant_bytes
        self._linear = GGUFLinearMethod()
        self._embedding = GGUFEmbeddingMethod()

    @classmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> GGUFConfig:
        resolved = getattr(model_config, "resolved", None)
        path = getattr(resolved, "gguf_path", None)
        if path is None or getattr(model_config, "load_format", "gguf") != "gguf":
            raise ValueError("quantization 'gguf' needs a GGUF checkpoint (a .gguf file "
                             "loaded with load_format 'gguf')")
        from pagedllm.model_files.gguf_file import GGUFFile

        counts: Counter[str] = Counter()
        n_bytes = 0
        for t in GGUFFile(path).tensors:
            if len(t.shape) == 2:
                counts[gb.type_name(t.ggml_type)] += 1
                n_bytes += t.n_bytes
        return cls(counts, n_bytes)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return self._linear

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        return self._embedding

    def check_device(self, device: str, dtype: str) -> None:
        self._device = device  # for describe(): which kernels, which activations
        if device == "cpu" and not cpu_kernel_available():
            raise ValueError("quantization 'gguf': this torch has no CPU int4 kernel "
                             "(_weight_int4pack_mm_for_cpu); pass quantization='none'")

    def describe(self) -> str:
        types = ", ".join(f"{n} x{c}" for n, c in sorted(self.type_counts.items()) if c)
        bits = sorted({gb.BITS[gb.Q[n]] for n in self.type_counts
                       if n in gb.Q.__members__ and gb.Q[n] in gb.BITS})
        # A VNNI / AVX2 CPU's kernels take int8 activations as ggml's do (module doc).
        acts = "int8 activations (VNNI / AVX2 kernels)" if getattr(self, "_device", None) == "cpu" \
            and int4_vnni.available() else "bf16 activations"
        return (f"gguf ({types}; {'/'.join(map(str, bits))}-bit codes, group "
                f"{gb.GROUP} int4 kernels, {acts}; "
                f"{self.quant_bytes / (1 << 20):.1f} MiB of 2-D tensors in the file)")
