"""FP8 W8A8 linear layers: e4m3 weights with per-output-channel scales, activations
quantised per token on the fly.

```
 weight      [out, in]  float8_e4m3fn      w ~= weight * weight_scale[:, None]
 weight_scale [out]     float32            (a per-tensor scale is stored broadcast)
 x  [T, in]  --per-token amax / 448-->  x_q [T, in] e4m3, x_scale [T, 1] fp32
 y = (x_q @ weight^T) * x_scale * weight_scale + bias        in the model dtype
```

Where the weights come from (``Fp8Config.from_config``):

* an unquantised (bf16 / fp16 / fp32) checkpoint with ``quantization="fp8"``: the layer
  registers a plain weight, the loader (or ``load_format="dummy"``) fills it, and
  ``process_weights_after_loading`` quantises it with one scale per (fused) weight
  tensor, stored broadcast over the output channels, as vLLM does at load time (under
  tensor parallelism: each rank's shard has its own, as in vLLM;
  ``Fp8Config(weight_per_tensor=False)``: one scale per output channel);
* a Hugging Face FP8 checkpoint (``quantization_config.quant_method == "fp8"``):
  ``weight`` is e4m3 with ``weight_scale`` (per tensor or per channel) or
  ``weight_scale_inv`` (``weight_block_size`` blocks, transformers' fine-grained FP8).
  On CUDA the blocks are kept (``weight_block_scale [ceil(out / bo), ceil(in / bi)]``)
  and every linear runs the Triton block-scaled GEMM of ``kernels/fp8_block_gemm.py``
  with activations quantised per token and group of ``bi`` columns (no requantisation:
  exact to fp8 rounding).  On the CPU (and for block columns that are not a power of
  two >= 16, or with static activation scales) the block scales are folded at load
  into per-channel ones (dequantise, requantise: one more rounding).  Under tensor
  parallelism a rank's shard must be whole blocks (``ValueError`` naming
  ``weight_block_size`` otherwise);
* compressed-tensors ``float-quantized`` checkpoints, through ``compressed_tensors.py``,
  which hands the same ``Fp8LinearMethod`` its per-channel or per-tensor scales.

The GEMM is ``torch._scaled_mm`` (cuBLASLt, row-wise scales) on CUDA GPUs of compute
capability >= 8.9, except where the tuned table of ``kernels/fp8_gemm.py`` routes a
decode-sized batch to its Triton kernel and at one row (the e4m3 GEMV of
``kernels/gemv.py``); on the CPU (and as every GPU path's oracle) the reference upcasts the
stored e4m3 values and multiplies in float32 -- the same quantised operands, so the two
differ only by accumulation order.  Embeddings and lm_head are never quantised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.kernels.quant_common import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_fp8_rows,
    quantize_fp8_tensor,
)
from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    set_weight_attrs,
)

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase

# (major, minor) compute capability from which cuBLASLt has FP8 GEMMs (Ada, Hopper).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_linear_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                         w_scale: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """``(x_q @ w_q^T) * x_scale * w_scale + bias`` by upcasting to float32 (the CPU path
    and the oracle of ``torch._scaled_mm``).  ``x_scale: [T, 1]``, ``w_scale: [out]``."""
    y = (x_q.float() @ w_q.float().t()) * x_scale * w_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def check_fp8_capability(capability: tuple[int, int], device_name: str = "GPU") -> None:
    """``ValueError`` naming ``quantization`` if a GPU of ``capability`` has no FP8 GEMMs."""
    if tuple(capability) < FP8_MIN_CAPABILITY:
        from pagedllm.layers.quantization import quantization_names

        raise ValueError(
            f"quantization='fp8' needs a GPU of compute capability >= "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (Ada, Hopper); {device_name} "
            f"is {capability[0]}.{capability[1]}; choose another quantization "
            f"({', '.join(n for n in quantization_names() if n != 'fp8')}) or run on CPU")


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, layer: LinearBase,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt FP8 GEMM with row-wise scales (per token x per channel).  Row-wise
    scaling needs a bf16 output; other dtypes are cast afterwards."""
    y = torch._scaled_mm(x_q, layer.weight.t(), scale_a=x_scale,
                         scale_b=layer.weight_scale_row, out_dtype=torch.bfloat16,
                         bias=None if bias is None else bias.to(torch.bfloat16))
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


class Fp8LinearMethod(LinearMethodBase):
    """W8A8 FP8 for one linear layer (see the module doc for the storage contract).

    ``serialized``: the checkpoint holds e4m3 weights (else a float weight is loaded and
    quantised after loading).  ``block_size``: the checkpoint's ``weight_block_size``
    (``weight_scale_inv`` of ``[ceil(out / bo), ceil(in / bi)]``), None for per-tensor /
    per-channel ``weight_scale``.  ``input_scale``: the checkpoint also holds static
    per-tensor activation scales (one per fused shard; their max is used, as vLLM does);
    otherwise activations are quantised per token.  ``block_scale_name``: the block
    scales' tensor name (compressed-tensors calls them ``weight_scale``)."""

    def __init__(self, serialized: bool = False, weight_per_tensor: bool = False,
                 block_size: tuple[int, int] | None = None,
                 input_scale: bool = False,
                 block_scale_name: str = "weight_scale_inv") -> None:
        self.serialized = serialized
        self.block_scale_name = block_scale_name
        self.weight_per_tensor = weight_per_tensor
        self.block_size = block_size
        self.input_scale = input_scale

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        out = sum(output_partition_sizes)
        wdtype = FP8_DTYPE if self.serialized else params_dtype
        weight = nn.Parameter(torch.empty(out, input_size_per_partition, dtype=wdtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)
        if not self.serialized:
            return
        if self.block_size is not None:
            bo, bi = self.block_size
            _check_block_shards(layer, self.block_size, input_size_per_partition,
                                input_size, output_partition_sizes, output_size)
            inv = nn.Parameter(torch.empty(-(-out // bo), -(-input_size_per_partition // bi),
                                           dtype=torch.float32), requires_grad=False)
            # Fused shards (q/k/v, gate/up) start at multiples of the block: offsets in
            # rows divide by ``bo`` exactly as packed elements do.
            set_weight_attrs(inv, {"output_dim": 0, "input_dim": 1, "packed_dim": 0,
                                   "packed_factor": bo})
            layer.register_parameter(self.block_scale_name, inv)
        else:
            scale = nn.Parameter(torch.empty(out, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"output_dim": 0,
                                     "weight_loader": _scale_loader(layer)})
            layer.register_parameter("weight_scale", scale)
        if self.input_scale:
            n = len(output_partition_sizes)
            inp = nn.Parameter(torch.ones(n, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(inp, {"weight_loader": _input_scale_loader(layer)})
            layer.register_parameter("input_scale", inp)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = layer.weight.data
        if not self.serialized:
            if self.weight_per_tensor:
                q, s = quantize_fp8_tensor(w)
                s = s.expand(w.shape[0]).contiguous()
            else:
                q, s = quantize_fp8_rows(w)
        elif self.block_size is not None and not self.input_scale \
                and keeps_block_scales(w, self.block_size):
            # Kept as the checkpoint ships them: the block GEMM applies them per K group.
            inv = getattr(layer, self.block_scale_name).data.float().contiguous()
            delattr(layer, self.block_scale_name)
            layer.weight = nn.Parameter(w.contiguous(), requires_grad=False)
            layer.weight_block_scale = nn.Parameter(inv, requires_grad=False)
            return
        elif self.block_size is not None:
            bo, bi = self.block_size
            inv = getattr(layer, self.block_scale_name).data
            full = inv.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)
            q, s = quantize_fp8_rows(w.float() * full[:, :w.shape[1]])
            delattr(layer, self.block_scale_name)
        else:
            q, s = w, layer.weight_scale.data
        layer.weight = nn.Parameter(q.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(s.reshape(-1).float().contiguous(),
                                          requires_grad=False)
        # The [1, out] view _scaled_mm wants (a view: no extra memory).
        layer.weight_scale_row = layer.weight_scale.data.view(1, -1)
        if self.input_scale:
            layer.input_scale_max = layer.input_scale.data.max().reshape(1, 1)

    def dummy_init(self, layer: LinearBase, generator: torch.Generator, init: str) -> bool:
        if not self.serialized:
            return False  # the loader fills the float weight; quantised after
        # An FP8 checkpoint's layout with dummy values: weights drawn in float, then
        # stored e4m3 (uniform(-1e-3, 1e-3) is below e4m3's subnormals at scale 1, so
        # the scale is the tensor's, as a real checkpoint's would be).
        w = torch.empty(layer.weight.shape, device=layer.weight.device)
        if init == "uniform":
            w.uniform_(-1e-3, 1e-3, generator=generator)
        else:
            w.normal_(0.0, 0.02, generator=generator)
        q, s = quantize_fp8_tensor(w)
        layer.weight.data.copy_(q)
        if self.block_size is not None:
            getattr(layer, self.block_scale_name).data.fill_(float(s))
        else:
            layer.weight_scale.data.fill_(float(s))
        if self.input_scale:
            layer.input_scale.data.fill_(1.0)
        return True

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ready, layer.fp8_input = getattr(layer, "fp8_input", None), None
        block_scale = getattr(layer, "weight_block_scale", None)
        if block_scale is not None:  # block-wise checkpoint kept as blocks (CUDA)
            from pagedllm.kernels.fp8_block_gemm import fp8_block_linear

            assert self.block_size is not None
            y = fp8_block_linear(x2, layer.weight, block_scale, self.block_size, bias)
            return y.reshape(*shape[:-1], y.shape[-1])
        if ready is not None and ready[0] is x:  # quantised by the norm before
            x_q, x_s = ready[1], ready[2]
        elif self.input_scale:  # static: one checkpoint scale for every token
            x_s = layer.input_scale_max.expand(x2.shape[0], 1).contiguous()
            x_q = (x2.float() / x_s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        elif x2.is_cuda:
            from pagedllm.kernels.fp8_quant import quantize_fp8_per_token

            x_q, x_s = quantize_fp8_per_token(x2)
        else:
            x_q, x_s = quantize_fp8_rows(x2)
        if x2.is_cuda and x2.shape[0] == 1:
            # Batch-1 decode: one read of the e4m3 weight (kernels/gemv.py), where
            # cuBLASLt's FP8 GEMM at M = 1 ran W4 slower than the bf16 GEMV.
            from pagedllm.kernels.gemv import gemv

            y = gemv(x_q, layer.weight, bias, out=torch.empty(
                1, layer.weight.shape[0], dtype=x.dtype, device=x.device),
                x_scale=x_s, w_scale=layer.weight_scale)
        elif x2.is_cuda:
            from pagedllm.kernels.fp8_gemm import fp8_gemm, fp8_gemm_route

            w = layer.weight
            cfg = fp8_gemm_route(x2.shape[0], w.shape[0], w.shape[1])
            if cfg is not None:  # decode-sized M, where cuBLASLt's one tile idles SMs
                y = fp8_gemm(x_q, x_s, w, layer.weight_scale, bias, x.dtype, cfg)
            else:
                y = _scaled_mm(x_q, x_s, layer, bias, x.dtype)
        else:
            y = fp8_linear_reference(x_q, x_s, layer.weight, layer.weight_scale, bias,
                                     x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])

    def rms_norm_input(self, layer: LinearBase, x: torch.Tensor,
                       residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        # On CUDA the norm kernel also quantises its output row per token (it holds the
        # row in registers): one launch and one read of the row less per norm.  The
        # quantised row waits on the layer for apply() of that very output tensor.
        # Kept block scales quantise per token group in the GEMM's own quantiser.
        if getattr(layer, "weight_block_scale", None) is not None:
            return None
        if not x.is_cuda or self.input_scale or x.dim() != 2 \
                or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1 \
                or (residual is not None and residual.stride(1) != 1):
            return None
        from pagedllm.kernels.norm import rms_norm_fp8

        out, res_out, q, s = rms_norm_fp8(x, residual, weight, eps)
        layer.fp8_input = (out, q, s)
        return out if res_out is None else (out, res_out)


def keeps_block_scales(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether a block-wise checkpoint's layer keeps its block scales and runs the block
    GEMM: on CUDA, with block columns (the activation group and the kernel's K step) a
    power of two >= 16.  Elsewhere the scales fold into per-channel ones (module doc)."""
    bi = block[1]
    return weight.is_cuda and bi >= 16 and not bi & (bi - 1)


def _check_block_shards(layer: LinearBase, block: tuple[int, int], in_per_partition: int,
                        input_size: int, output_partition_sizes: list[int],
                        output_size: int) -> None:
    """``ValueError`` naming ``weight_block_size`` when a tensor-parallel rank's shard is
    not whole blocks: its block scales (and the GEMM's K groups) would straddle ranks."""
    tp = getattr(layer, "tp_size", 1)
    if tp <= 1:
        return
    bo, bi = block
    if in_per_partition != input_size and in_per_partition % bi:
        what = f"{in_per_partition} input features"
    elif sum(output_partition_sizes) != output_size and any(
            p % bo for p in output_partition_sizes):
        what = f"output shards of {output_partition_sizes} features"
    else:
        return
    raise ValueError(
        f"quantization_config.weight_block_size {list(block)} does not divide the "
        f"tensor-parallel shard of {getattr(layer, 'prefix', '') or type(layer).__name__} "
        f"({what} per rank at tensor_parallel_size {tp}); choose a tensor_parallel_size "
        f"whose shards are whole blocks")


def _scale_loader(layer: LinearBase) -> Any:
    """Loader of a ``[out]`` per-channel ``weight_scale`` that also takes a checkpoint's
    per-tensor scalar (broadcast over the shard's rows) and ``[out, 1]`` columns."""

    def load(param: nn.Parameter, loaded: torch.Tensor,
             shard_id: int | str | None = None) -> None:
        loaded = loaded.float()
        if shard_id is None:
            rows = param.data
            src, total = layer.tp_rank * rows.numel(), rows.numel() * layer.tp_size
        else:  # where this rank's rows sit, and where they come from in the shard
            offset, size, src, total = layer._shard_range(shard_id)  # type: ignore[attr-defined]
            rows = param.data.narrow(0, offset, size)
        if loaded.numel() == 1:
            rows.fill_(float(loaded.reshape(())))
            return
        loaded = loaded.reshape(-1)
        if getattr(layer, "in_per_partition", None) != layer.input_size:
            src, total = 0, rows.numel()  # row-parallel: output channels are not split
        if loaded.numel() != total:
            raise ValueError(f"weight_scale has {loaded.numel()} entries, expected "
                             f"{total} (one per output channel) or 1")
        rows.copy_(loaded.narrow(0, src, rows.numel()))

    return load


def _input_scale_loader(layer: LinearBase) -> Any:
    """Loader of a static per-tensor ``input_scale`` (one entry per fused shard)."""

    def load(param: nn.Parameter, loaded: torch.Tensor,
             shard_id: int | str | None = None) -> None:
        idx = 0 if shard_id is None else layer._shard_index(shard_id)
        param.data[idx].copy_(loaded.float().reshape(-1)[0])

    return load


def _name_matches(prefix: str, patterns: list[str]) -> bool:
    """Whether layer ``prefix`` is one of the checkpoint's ignored modules (by name, by a
    fused layer's parts, or by a ``re:`` pattern as compressed-tensors writes them)."""
    import re

    parts = [prefix]
    for fused, pieces in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                          ("gate_up_proj", ("gate_proj", "up_proj"))):
        if prefix.endswith(fused):
            parts = [prefix[:-len(fused)] + p for p in pieces]
    for pat in patterns:
        for p in parts:
            if pat.startswith("re:"):
                if re.match(pat[3:], p):
                    return True
            elif p == pat or p.endswith("." + pat):
                return True
    return False


class Fp8Config(QuantizationConfig):
    """``quantization="fp8"``: quantise at load, or run an HF FP8 checkpoint.

    ``ignored``: HF module names kept unquantised (``ignored_layers`` /
    ``modules_to_not_convert`` of the checkpoint); lm_head always is."""

    name = "fp8"

    def __init__(self, serialized: bool = False, weight_per_tensor: bool = False,
                 block_size: tuple[int, int] | None = None,
                 ignored: list[str] | None = None, input_scale: bool = False) -> None:
        self.method = Fp8LinearMethod(serialized, weight_per_tensor, block_size,
                                      input_scale)
        self.ignored = list(ignored or [])

    @classmethod
    def from_config(cls, hf_config: Any, model_config: Any) -> Fp8Config:
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            # Quantised at load: one weight scale per tensor, as vLLM's online fp8 does.
            # Measured on SmolLM2 (docs/benchmarks.md, "where fp8's perplexity cost comes
            # from"), it costs less than per-channel scales on every sample tried.
            return cls(weight_per_tensor=True)
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported; "
                             f"supported: e4m3")
        block = qc.get("weight_block_size")
        if block is not None:
            if len(block) != 2:
                raise ValueError(f"quantization_config.weight_block_size must be [rows, "
                                 f"cols], got {block!r}")
            block = (int(block[0]), int(block[1]))
        ignored = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
        static = qc.get("activation_scheme", "dynamic") == "static"
        return cls(serialized=True, block_size=block, ignored=ignored, input_scale=static)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if prefix.endswith("lm_head") or _name_matches(prefix, self.ignored):
            return None
        return self.method

    def get_moe_method(self, layer: nn.Module, prefix: str) -> Any:
        """FP8 experts (``fp8_moe.Fp8MoEMethod``, weight-only, per-channel scales;
        ``weight_block_size`` scales folded at load), or None when the checkpoint lists
        them as ignored."""
        from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod

        if _name_matches(prefix, self.ignored):
            return None
        m = self.method
        return Fp8MoEMethod(serialized=m.serialized, input_scale=m.input_scale,
                            block_size=m.block_size)

    def check_device(self, device: str, dtype: str) -> None:
        if device != "cuda":
            return
        idx = torch.cuda.current_device()
        check_fp8_capability(torch.cuda.get_device_capability(idx),
                             torch.cuda.get_device_name(idx))

    def describe_kernels(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return None
        from pagedllm.kernels.fp8_gemm import routing_summary

        return routing_summary()

    def describe(self) -> str:
        m = self.method
        if not m.serialized:
            gran = "per-tensor" if m.weight_per_tensor else "per-channel"
            return f"fp8 (e4m3 W8A8, quantised at load, {gran} weight scales, per-token " \
                   f"activations; MoE experts e4m3 weight-only, per-channel)"
        src = (f"block {m.block_size} scales (block GEMM on CUDA, folded per channel on "
               f"CPU)" if m.block_size else "weight_scale")
        return f"fp8 (e4m3 W8A8 checkpoint, {src}, per-token activations; MoE experts " \
               f"weight-only)"
