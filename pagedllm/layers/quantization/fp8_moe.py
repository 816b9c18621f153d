"""FP8 mixture-of-experts: e4m3 expert weights with a float32 scale per expert and output
channel, multiplied weight-only (activations stay in the model dtype).

```
 w13_weight       [E, 2I, H]  float8_e4m3fn     rows [gate_e | up_e] (as FusedMoE)
 w13_weight_scale [E, 2I]     float32           w13[e, n, :] ~= w13_weight[e, n, :] * s[e, n]
 w2_weight        [E, H, I]   float8_e4m3fn
 w2_weight_scale  [E, H]      float32
```

Where the weights come from:

* ``quantization="fp8"`` on a float (bf16 / fp16 / fp32) MoE checkpoint: each expert
  matrix is quantised per output channel *as it loads* (this rank's slice of it), so the
  float expert bank is never held whole -- a Mixtral-8x7B in bf16 would not fit twice;
* a Hugging Face FP8 checkpoint (``quant_method: fp8`` without ``weight_block_size``):
  ``experts.{e}.{gate,up,down}_proj.weight`` e4m3 with ``.weight_scale`` per tensor
  (a scalar, broadcast over the rows) or per channel (``[out]`` / ``[out, 1]``);
* a compressed-tensors ``float-quantized`` checkpoint (``FP8_DYNAMIC`` channel strategy,
  ``FP8`` tensor strategy, ``FP8_BLOCK``): the same tensor names (``compressed_tensors.py``);
* block-wise FP8 (transformers' fine-grained FP8, ``weight_block_size`` with
  ``weight_scale_inv``, the layout of Qwen's / DeepSeek's official FP8 releases;
  compressed-tensors' block strategy names the block scales ``weight_scale``): the
  block scales load into ``{w13,w2}_{weight_scale_inv}`` and fold at load into
  per-channel ones (dequantise an expert in fp32, requantise per row: one more e4m3
  rounding, one kernel for every layout -- as ``fp8.Fp8LinearMethod`` does).  Under
  tensor parallelism a rank's intermediate slice must be whole blocks, else a
  ``ValueError`` naming ``weight_block_size`` (:func:`refuse_block_fp8`).

Static activation scales (``input_scale``: ``activation_scheme: static``, the ``FP8``
preset) are loaded and ignored: the experts run weight-only, which is at least as exact.

Compute: on CUDA (or ``layer.use_triton``) the sorted fused-MoE kernels with ``W_FP8``
(``kernels/fused_moe.py``: e4m3 tiles upcast in registers, the scale applied to the fp32
accumulator columns) at every batch size -- an FP8 variant of the batch-1 decode GEMVs
(``kernels/fused_moe_decode.py``) is a later step.  Elsewhere, and as the oracle, the
torch reference upcasts each routed expert times its scales
(``layers/fused_moe/torch_ref.py``).  Tensor parallelism: ``w13`` rows and their scales
shard together; ``w2`` shards its input columns, so its per-row scales are whole
(checkpoint scales) or this rank's (quantised at load).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels.quant_common import (
    FP8_DTYPE,
    quantize_fp8_rows,
    quantize_fp8_tensor,
)
from pagedllm.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref
from pagedllm.layers.quantization.base import set_weight_attrs

__all__ = ["Fp8MoEMethod", "refuse_block_fp8"]


def refuse_block_fp8(scheme: str, prefix: str) -> ValueError:
    """The error for a block-wise FP8 MoE layout that cannot load (``scheme`` names
    it): a tensor-parallel slice that cuts a block."""
    return ValueError(
        f"{scheme} FP8 MoE experts ({prefix}) are not supported: choose a tensor_parallel"
        f"_size whose expert slices are whole blocks, or run the checkpoint's bf16 "
        f"release with quantization='fp8' (quantised at load, per channel)")


class Fp8MoEMethod(FusedMoEMethodBase):
    """Weight-only FP8 experts (see the module doc for the storage contract).

    ``serialized``: the checkpoint holds e4m3 experts and their ``weight_scale`` (else
    float experts are quantised as they load).  ``input_scale``: the checkpoint also
    holds static activation scales (loaded, unused).  ``block_size``: the checkpoint's
    ``(rows, cols)`` weight blocks, their scales named ``block_scale_name``
    (``weight_scale_inv``; compressed-tensors: ``weight_scale``), folded at load."""

    def __init__(self, serialized: bool = False, input_scale: bool = False,
                 block_size: tuple[int, int] | None = None,
                 block_scale_name: str = "weight_scale_inv") -> None:
        self.serialized = serialized
        self.input_scale = input_scale
        self.block_size = block_size
        self.block_scale_name = block_scale_name

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_per_partition: int, params_dtype: torch.dtype) -> None:
        i, h = intermediate_per_partition, hidden_size
        shapes = {"w13": ((num_experts, 2 * i, h), (num_experts, 2 * i)),
                  "w2": ((num_experts, h, i), (num_experts, h))}
        for name, (wshape, sshape) in shapes.items():
            w = nn.Parameter(torch.empty(wshape, dtype=FP8_DTYPE), requires_grad=False)
            s = torch.ones(sshape, dtype=torch.float32)
            layer.register_parameter(f"{name}_weight", w)
            if self.block_size is not None:
                set_weight_attrs(w, {"weight_loader": _fp8_weight_loader(layer)})
                _create_block_scales(layer, name, self.block_size, self.block_scale_name)
            elif self.serialized:
                set_weight_attrs(w, {"weight_loader": _fp8_weight_loader(layer)})
                s = nn.Parameter(s, requires_grad=False)
                set_weight_attrs(s, {"weight_loader": _scale_loader(layer)})
                layer.register_parameter(f"{name}_weight_scale", s)
            else:
                # Scales made at load are a buffer: no checkpoint tensor is expected for
                # them (the loader's missing-parameter check), the weight's loader fills it.
                layer.register_buffer(f"{name}_weight_scale", s)
                set_weight_attrs(w, {"weight_loader": _quantizing_loader(layer, name)})
            if self.serialized and self.input_scale:
                inp = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                   requires_grad=False)
                set_weight_attrs(inp, {"weight_loader": _input_scale_loader(layer)})
                layer.register_parameter(f"{name}_input_scale", inp)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Block scales -> per-channel ones (dequantise one expert in fp32, requantise
        per row: one more e4m3 rounding, and one kernel for every layout)."""
        if self.block_size is None:
            return
        bo, bi = self.block_size
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight")
            inv = getattr(layer, f"{name}_{self.block_scale_name}").data
            rows, cols = w.shape[1:]
            scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                full = inv[e].repeat_interleave(bo, 0).repeat_interleave(bi, 1)
                if name == "w13":  # gate and up have block grids of their own
                    half = inv.shape[1] // 2 * bo
                    full = torch.cat([full[:rows // 2], full[half:half + rows // 2]])
                q, sc = quantize_fp8_rows(w.data[e].float() * full[:rows, :cols])
                w.data[e].copy_(q)
                scales[e] = sc.reshape(-1)
            delattr(layer, f"{name}_{self.block_scale_name}")
            layer.register_buffer(f"{name}_weight_scale", scales)

    def dummy_init(self, layer: FusedMoE, generator: torch.Generator, init: str) -> bool:
        """Random float experts (``init`` as the loader's: "uniform" or "normal"),
        quantised per channel one expert at a time (a float copy of one expert, never
        of the bank); block layouts get a scale per expert in every block, folded as a
        checkpoint's would be.  Returns True: every parameter of the layer is filled."""
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight")
            s = getattr(layer, f"{name}_{self.block_scale_name}" if self.block_size
                        else f"{name}_weight_scale")
            for e in range(w.shape[0]):
                f = torch.empty(w.shape[1:], device=w.device)
                if init == "uniform":
                    f.uniform_(-1e-3, 1e-3, generator=generator)
                else:
                    f.normal_(0.0, 0.02, generator=generator)
                if self.block_size is not None:
                    q, sc = quantize_fp8_tensor(f)
                    s.data[e].fill_(float(sc))
                else:
                    q, sc = quantize_fp8_rows(f)
                    s.data[e].copy_(sc.reshape(-1))
                w.data[e].copy_(q)
            inp = getattr(layer, f"{name}_input_scale", None)
            if inp is not None:
                inp.data.fill_(1.0)
        return True

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or layer.use_triton:
            from pagedllm.kernels.fused_moe import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                 topk_ids, w13_scale=layer.w13_weight_scale,
                                 w2_scale=layer.w2_weight_scale)
        return fused_experts_ref(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                 topk_ids, layer.w13_weight_scale, layer.w2_weight_scale)

    def describe(self) -> str:
        src = "e4m3 checkpoint" if self.serialized else "quantised at load"
        if self.block_size is not None:
            src += f", block {list(self.block_size)} scales folded per channel"
        return f"fp8 MoE experts (e4m3 weight-only, per-channel scales, {src})"


def _scale_rows(layer: FusedMoE, data: torch.Tensor, shard_id: str,
                expert_id: int) -> torch.Tensor | None:
    """The rows of a ``[E_local, N]`` scale that one expert matrix's channels own."""
    local = expert_id - layer.expert_start
    if not 0 <= local < layer.num_local_experts:
        return None
    i = layer.intermediate_per_partition
    if shard_id == "w1":
        return data[local].narrow(0, 0, i)
    if shard_id == "w3":
        return data[local].narrow(0, i, i)
    if shard_id == "w2":
        return data[local]
    raise ValueError(f"expert shard_id must be w1, w2 or w3, got {shard_id!r}")


def _fp8_weight_loader(layer: FusedMoE) -> Any:
    """An e4m3 checkpoint matrix, copied as is (the layer's own slicing)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
             expert_id: int) -> None:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 checkpoint expert weight must be float8_e4m3fn, got "
                             f"{loaded.dtype}")
        layer.weight_loader(param, loaded, shard_id, expert_id)

    return load


def _scale_loader(layer: FusedMoE) -> Any:
    """A checkpoint ``weight_scale``: a per-tensor scalar (broadcast over the matrix's
    rows) or one entry per output channel (``[out]`` / ``[out, 1]``; gate/up rows are
    this rank's slice, down rows are never split)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
             expert_id: int) -> None:
        rows = _scale_rows(layer, param.data, shard_id, expert_id)
        if rows is None:
            return
        loaded = loaded.float().reshape(-1)
        if loaded.numel() == 1:
            rows.fill_(float(loaded[0]))
            return
        split = shard_id != "w2"  # gate/up output channels are tensor-parallel rows
        total = rows.numel() * (layer.tp_size if split else 1)
        if loaded.numel() != total:
            raise ValueError(f"weight_scale of expert {expert_id} {shard_id} has "
                             f"{loaded.numel()} entries, expected {total} (one per output "
                             f"channel) or 1")
        start = layer.tp_rank * rows.numel() if split else 0
        rows.copy_(loaded.narrow(0, start, rows.numel()))

    return load


def _quantizing_loader(layer: FusedMoE, name: str) -> Any:
    """A float checkpoint matrix, quantised per output channel (this rank's slice) into
    the e4m3 parameter ``{name}_weight`` and its rows of ``{name}_weight_scale``."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
             expert_id: int) -> None:
        hit = layer.expert_shard(param.data, loaded, shard_id, expert_id)
        if hit is None:
            return
        dst, src = hit
        if src.dtype == FP8_DTYPE:
            raise ValueError("quantization='fp8' quantises float experts at load, but the "
                             "checkpoint's are already float8 without scales")
        q, s = quantize_fp8_rows(src.to(dst.device))
        dst.copy_(q)
        rows = _scale_rows(layer, getattr(layer, f"{name}_weight_scale"), shard_id,
                           expert_id)
        assert rows is not None
        rows.copy_(s.reshape(-1))

    return load


def _input_scale_loader(layer: FusedMoE) -> Any:
    """A static activation scale (``[E_local]``: the max over an expert's gate/up)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
             expert_id: int) -> None:
        local = expert_id - layer.expert_start
        if 0 <= local < layer.num_local_experts:
            value = loaded.float().reshape(-1).max()
            param.data[local] = torch.maximum(param.data[local], value.to(param.device))

    return load


def _create_block_scales(layer: FusedMoE, name: str, block: tuple[int, int],
                         scale_name: str) -> None:
    """``{name}_{scale_name}``: a checkpoint's block scales, ``[E, 2 * nb(I), nb(H)]``
    for w13 (gate's block rows, then up's: each matrix has its own grid) and
    ``[E, nb(H), nb(I)]`` for w2.  Under tensor parallelism a rank's slice of the
    intermediate dimension must be whole blocks (else ``refuse_block_fp8``)."""
    bo, bi = block
    i, h, e = layer.intermediate_per_partition, layer.hidden_size, layer.num_local_experts
    if layer.tp_size > 1 and (i % bo or i % bi):
        raise refuse_block_fp8(
            f"block-wise (weight_block_size {list(block)}) with a tensor-parallel slice "
            f"of {i} intermediate features (not whole blocks)", layer.prefix)
    shape = ((e, 2 * -(-i // bo), -(-h // bi)) if name == "w13"
             else (e, -(-h // bo), -(-i // bi)))
    p = nn.Parameter(torch.ones(shape, dtype=torch.float32), requires_grad=False)
    set_weight_attrs(p, {"weight_loader": _block_scale_loader(layer, block)})
    layer.register_parameter(f"{name}_{scale_name}", p)


def _block_scale_loader(layer: FusedMoE, block: tuple[int, int]) -> Any:
    """One expert matrix's block scales: gate/up into their half of the block rows
    (this rank's block rows), down's whole block rows and this rank's block columns."""
    bo, bi = block

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
             expert_id: int) -> None:
        local = expert_id - layer.expert_start
        if not 0 <= local < layer.num_local_experts:
            return
        dst = param.data[local]
        if shard_id in ("w1", "w3"):
            n = dst.shape[0] // 2
            dst, dim = dst.narrow(0, 0 if shard_id == "w1" else n, n), 0
        elif shard_id != "w2":
            raise ValueError(f"expert shard_id must be w1, w2 or w3, got {shard_id!r}")
        else:
            dim = 1
        n = dst.shape[dim]
        start = layer.tp_rank * n if layer.tp_size > 1 else 0
        expect = list(dst.shape)
        if layer.tp_size > 1:
            expect[dim] *= layer.tp_size
        if list(loaded.shape) != expect:
            raise ValueError(f"block scales of expert {expert_id} {shard_id}: expected "
                             f"{tuple(expect)} for blocks {list(block)}, got "
                             f"{tuple(loaded.shape)}")
        dst.copy_(loaded.narrow(dim, start, n).float())

    return load
