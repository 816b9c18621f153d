"""Test fixtures for integer checkpoints.

* compressed-tensors: written by the library itself (``apply_quantization_config`` +
  ``calculate_qparams`` + ``ModelCompressor``) from a tiny random Llama, as
  ``fp8_fixtures.save_compressed_tensors`` does for FP8;
* GPTQ and AWQ: packed by reference packers written here from the formats' published
  bit layouts (no GPTQ/AWQ library installs on this CPU-only, offline machine), see
  :func:`pack_gptq` and :func:`pack_awq`.
"""

from __future__ import annotations

import copy
import json
import os

import torch
import transformers


def ct_scheme(bits: int, strategy: str, group_size: int | None = None,
              symmetric: bool = True, w8a8: bool = False) -> dict:
    """A compressed-tensors ``QuantizationScheme`` kwargs dict (weights [+ activations])."""
    from compressed_tensors.quantization import QuantizationArgs

    w = QuantizationArgs(num_bits=bits, type="int", strategy=strategy,
                         group_size=group_size, symmetric=symmetric)
    a = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True,
                         dynamic=True) if w8a8 else None
    return {"weights": w, "input_activations": a}


def save_ct_int(model: torch.nn.Module, path: str, scheme: dict, fmt: str,
                ignore: list[str] | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Quantise ``model`` with the library (``scheme`` from :func:`ct_scheme`), save it
    compressed as ``fmt`` under ``path``.  Returns ``(oracle, compressed)``: the
    library's fake-quantised model (its own forward, taken before compression) and the
    compressed in-memory model (for the library's ``decompress_model``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=ignore or ["lm_head"])
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for _, mod in model.named_modules():
            s = getattr(mod, "quantization_scheme", None)
            if s is None:
                continue
            w = mod.weight.data
            # min / max are the observer's whole job; the library makes the qparams.
            if s.weights.strategy == "group":
                wg = w.reshape(w.shape[0], -1, s.weights.group_size)
                lo, hi = wg.amin(-1), wg.amax(-1)
            else:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, zp = calculate_qparams(lo, hi, s.weights)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data.copy_(zp.reshape(mod.weight_zero_point.shape))
    oracle = copy.deepcopy(model)
    comp = ModelCompressor.from_pretrained_model(model, fmt)
    comp.compress_model(model)
    model.save_pretrained(path)
    comp.update_config(path)
    return oracle, model


def ct_decompressed_state(compressed: torch.nn.Module, fmt: str) -> dict[str, torch.Tensor]:
    """The library's decompression of a compressed model: ``{module name: weight}``."""
    from compressed_tensors.compressors import ModelCompressor

    m = copy.deepcopy(compressed)
    ModelCompressor.from_pretrained_model(m, fmt).decompress_model(m)
    return {name[:-len(".weight")]: t.detach().clone()
            for name, t in m.state_dict().items() if name.endswith("proj.weight")}


def float_twin(model: torch.nn.Module, weights: dict[str, torch.Tensor],
               seed: int, **overrides: object) -> transformers.LlamaForCausalLM:
    """A plain transformers Llama with ``weights`` (module name -> dequantised weight)
    and every other tensor from ``model``: what transformers runs for a checkpoint it
    cannot load itself."""
    from tests.layers.fp8_fixtures import tiny_llama

    twin = tiny_llama(seed=seed, **overrides)
    state = {k: v for k, v in model.state_dict().items() if k in twin.state_dict()}
    state.update({f"{k}.weight": v for k, v in weights.items()})
    twin.load_state_dict(state)
    return twin.eval()


# -- GPTQ / AWQ reference packers ---------------------------------------------------


def _quantise_groups(w: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor,
                     sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max round-to-nearest GPTQ-style quantisation of ``w [N, K]`` (no Hessian:
    the bit layout is what is under test): ``(codes [N, K], scales [N, K/G], zeros
    [N, K/G] int)``, ``w ~ (code - zero) * scale`` with input ``k`` in group
    ``g_idx[k]``."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    ng = k // group
    lo = torch.zeros(n, ng).scatter_reduce(1, g_idx.long().expand(n, -1), w, "amin")
    hi = torch.zeros(n, ng).scatter_reduce(1, g_idx.long().expand(n, -1), w, "amax")
    if sym:
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = (2 * amax / maxq).clamp(min=1e-8)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = ((hi - lo) / maxq).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, maxq)
    scale = scale.half().float()  # GPTQ / AWQ store fp16 scales
    gs, gz = scale[:, g_idx.long()], zero[:, g_idx.long()]
    codes = torch.clamp(torch.round(w / gs + gz), 0, maxq).to(torch.int64)
    return codes, scale, zero.to(torch.int64)


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's ``qweight`` packing (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
    ``pack``, the same loop in GPTQModel's ``PackableQuantLinear.pack``)::

        while row < qweight.shape[0]:
            for j in range(i, i + (32 // bits)):
                qweight[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits; row += 1

    ``v [R, C]`` -> ``int32 [R * bits / 32, C]``: word ``r`` holds rows
    ``r*P .. r*P + P - 1`` at bits ``0, bits, 2 bits, ...`` (written as that loop)."""
    p = 32 // bits
    r, c = v.shape
    out = torch.zeros(r // p, c, dtype=torch.int64)
    for row in range(r // p):
        for j in range(p):
            out[row] |= v[row * p + j] << (bits * j)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def pack_gptq(w: torch.Tensor, bits: int, group: int, desc_act: bool, sym: bool,
              seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A GPTQ (v1 checkpoint format) layer from ``w [N, K]``: ``({qweight [K/P, N],
    qzeros [K/G, N/P] holding zero - 1, scales [K/G, N] fp16, g_idx [K]}, the reference
    dequantisation [N, K])``.  ``desc_act``: GPTQ's act-order, ``g_idx = (position of
    k in a permutation) // G`` (here a random permutation standing in for the Hessian
    diagonal order)."""
    n, k = w.shape
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        inv = torch.argsort(perm)
        g_idx = (inv // group).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group).to(torch.int32)
    codes, scale, zero = _quantise_groups(w.float(), bits, group, g_idx, sym)
    if not sym:
        # The v1 format stores zero - 1 in ``bits`` bits: a zero of 0 does not survive
        # (AutoGPTQ's known flaw, fixed by gptq_v2), so real v1 zeros are >= 1.
        zero = zero.clamp(min=1)
        codes = torch.clamp(torch.round(w.float() / scale[:, g_idx.long()]
                                        + zero[:, g_idx.long()]), 0, (1 << bits) - 1
                            ).to(torch.int64)
    deq = (codes - zero[:, g_idx.long()]).float() * scale[:, g_idx.long()]
    qweight = _pack_rows(codes.t().contiguous(), bits)            # [K/P, N]
    # AutoGPTQ: ``zeros -= 1`` then packs along columns (N) the same way.
    qzeros = _pack_rows((zero - 1).contiguous(), bits).t().contiguous()  # [K/G, N/P]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous().half(),
            "g_idx": g_idx}, deq


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ awq/utils/packing_utils.py


def _pack_awq_cols(v: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing (awq/modules/linear/gemm.py ``WQLinear_GEMM.from_linear``)::

        for col in range(intweight.shape[1] // pack_num):
            for i in range(pack_num):
                qweight[:, col] |= intweight[:, col * pack_num + order_map[i]] << (i * 4)

    with ``order_map = AWQ_ORDER``: ``v [R, C]`` -> ``int32 [R, C / 8]``."""
    r, c = v.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An AWQ GEMM layer (4 bits, zero point) from ``w [N, K]``: ``({qweight [K, N/8],
    qzeros [K/G, N/8], scales [K/G, N] fp16}, the reference dequantisation [N, K])``
    (AutoAWQ's ``dequantize_gemm``: ``(iweight - izeros) * scales``)."""
    n, k = w.shape
    g_idx = (torch.arange(k) // group).to(torch.int32)
    codes, scale, zero = _quantise_groups(w.float(), 4, group, g_idx, sym=False)
    deq = (codes - zero[:, g_idx.long()]).float() * scale[:, g_idx.long()]
    return {"qweight": _pack_awq_cols(codes.t().contiguous()),
            "qzeros": _pack_awq_cols(zero.t().contiguous()),
            "scales": scale.t().contiguous().half()}, deq


def _input_seed(module: str) -> int:
    """One act-order permutation per layer *input*: GPTQ orders by the Hessian of the
    input, which q/k/v (and gate/up) share, so their g_idx are equal."""
    layer = int(module.split(".")[2])
    kind = module.rsplit(".", 1)[-1]
    shared = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2,
              "up_proj": 2, "down_proj": 3}
    return 10 * layer + shared[kind]


def save_int_checkpoint(model: torch.nn.Module, path: str, fmt: str, bits: int = 4,
                        group: int = 32, desc_act: bool = False, sym: bool = True
                        ) -> dict[str, torch.Tensor]:
    """Save ``model`` as a GPTQ (``fmt="gptq"``) or AWQ (``"awq"``) checkpoint with the
    reference packers; returns ``{module name: dequantised weight}``."""
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("proj.weight"):
            mod = name[:-len(".weight")]
            if fmt == "gptq":
                tensors, d = pack_gptq(t, bits, group, desc_act, sym, seed=_input_seed(mod))
            else:
                tensors, d = pack_awq(t, group)
            state.update({f"{mod}.{k}": v for k, v in tensors.items()})
            deq[mod] = d
        else:
            state[name] = t.contiguous()
    model.config.save_pretrained(path)
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
              "sym": sym, "checkpoint_format": "gptq"}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq
