"""The integer linear layers' GPU path (``int_linear.IntLinearMethod.store_canonical`` +
``kernels/wna16.py: wna16_gemm``) on GPTQ, AWQ and compressed-tensors weights: the
canonical tensors each format converts to, multiplied by the Triton kernel (under
``TRITON_INTERPRET=1`` without a GPU), against ``x @ w_ref^T`` of the formats' reference
dequantisation.  Skipped where the kernels module is absent."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagedllm.kernels.wna16")

from pagedllm.layers.linear import ReplicatedLinear  # noqa: E402
from pagedllm.layers.quantization.awq import AWQConfig  # noqa: E402
from pagedllm.layers.quantization.gptq import GPTQConfig  # noqa: E402
from tests.layers.int_fixtures import pack_awq, pack_gptq  # noqa: E402

N, K = 64, 128


def _layer(qc, tensors: dict[str, torch.Tensor], device: str) -> ReplicatedLinear:
    with torch.device(device):
        layer = ReplicatedLinear(K, N, bias=False, quant_config=qc, prefix="x")
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    m = layer.quant_method
    if device == "cuda":
        m.process_weights_after_loading(layer)
    else:  # the CUDA storage on CPU tensors, for the interpreter
        iw = m.to_int_weight(layer)
        for name in m.checkpoint_params:
            delattr(layer, name)
        layer.register_buffer("int_perm", None, persistent=False)
        m.store_canonical(layer, iw, torch.float32)
    assert layer.int_kind == "wna16"
    return layer


@pytest.mark.parametrize("case", ["gptq4_g32_sym", "gptq4_g32_actorder_asym",
                                  "gptq8_channel", "awq4_g32"])
@pytest.mark.parametrize("rows", [1, 20])
def test_wna16_layer_matches_reference(case: str, rows: int, device: str) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(N, K, generator=g) * 0.05
    if case.startswith("awq"):
        tensors, deq = pack_awq(w, 32)
        qc = AWQConfig(32, [])
    else:
        bits = int(case[4])
        group = K if "channel" in case else 32
        act, sym = "actorder" in case, "asym" not in case
        tensors, deq = pack_gptq(w, bits, group, act, sym, seed=3)
        qc = GPTQConfig(bits, None if "channel" in case else 32, act, sym, True, [])
    layer = _layer(qc, tensors, device)
    x = torch.randn(rows, K, generator=g).to(device)
    y = layer(x).float().cpu()
    ref = x.float().cpu() @ deq.T
    assert float((y - ref).abs().max()) < 1e-4 * max(1.0, float(ref.abs().max()))
