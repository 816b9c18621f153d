"""The per-token e4m3 activation quantiser (kernels/fp8_quant.py) against the torch
reference (layers/quantization/fp8.quantize_fp8_rows), and on a GPU the FP8 linear's
``torch._scaled_mm`` path against the upcasting reference at Llama-3-8B shapes, eager and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU

from pagedllm.kernels.fp8_quant import quantize_fp8_per_token
from pagedllm.kernels.quant_common import quantize_fp8_rows
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.fp8 import Fp8Config, fp8_linear_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (5, 6000), (2, 14336)])
def test_per_token_quant_matches_reference(shape: tuple[int, int],
                                           dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]
    x[0] = 0.0  # a zero token: scale at its floor, zeros out
    x[1, :8] = torch.tensor([448.0, -448.0, 1e-9, -1e-9, 13.0, 14.0, 0.0, -0.0])
    x = x.to(dtype).to(DEVICE)
    q, s = quantize_fp8_per_token(x)
    rq, rs = quantize_fp8_rows(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # Exactly the reference's rounding (ties to even, saturation, subnormals); at most
    # one e4m3 step apart where the GPU's fp32 division rounds differently.
    diff = (q.float() - rq.float()).abs()
    step = rq.float().abs().clamp(min=2.0 ** -6) * 2.0 ** -3
    assert torch.all(diff <= step)
    if not ON_GPU:
        assert torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 4096), (5, 96), (3, 1000)])
def test_rms_norm_fp8_equals_norm_then_quant(shape: tuple[int, int], residual: bool,
                                              ) -> None:
    """The RMSNorm that also quantises its output gives bit for bit the plain norm's
    output and residual, and the quantiser's values for that output."""
    from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8

    g = torch.Generator().manual_seed(shape[1] + residual)
    x, r = (torch.randn(shape, generator=g).to(torch.bfloat16).to(DEVICE) for _ in "xr")
    x[0] = 0.0 if not residual else x[0]  # a zero row (scale at its floor)
    w = (torch.rand(shape[1], generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    out, res_out, q, s = rms_norm_fp8(x, r if residual else None, w, 1e-5)
    if residual:
        ref, ref_res = fused_add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(res_out, ref_res)
    else:
        ref = rms_norm(x, w, 1e-5)
        assert res_out is None
    assert torch.equal(out, ref)
    rq, rs = quantize_fp8_per_token(ref)
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="torch._scaled_mm needs an FP8 GPU")
@pytest.mark.parametrize("tokens", [1, 7, 256, 2048])
def test_scaled_mm_linear_llama3_shapes(tokens: int) -> None:
    torch.manual_seed(tokens)
    cfg = Fp8Config()
    with torch.device(DEVICE):
        torch.set_default_dtype(torch.bfloat16)
        try:
            gu = MergedColumnParallelLinear(4096, [14336, 14336], quant_config=cfg,
                                            prefix="mlp.gate_up_proj")
            down = RowParallelLinear(14336, 4096, quant_config=cfg, prefix="mlp.down_proj")
        finally:
            torch.set_default_dtype(torch.float32)
    for layer in (gu, down):
        layer.weight.data.normal_(0, 0.02)
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(tokens, 4096, device=DEVICE, dtype=torch.bfloat16)
    y = gu(x)
    xq, xs = quantize_fp8_rows(x)
    ref = fp8_linear_reference(xq, xs, gu.weight, gu.weight_scale, None, torch.float32)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    h = torch.randn(tokens, 14336, device=DEVICE, dtype=torch.bfloat16)
    eager = down(h)
    graph = torch.cuda.CUDAGraph()
    static = h.clone()
    down(static)  # warm (compiles the quant kernel outside capture)
    with torch.cuda.graph(graph):
        out = down(static)
    static.copy_(h)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(48, 64), (40, 1000)])
def test_fp8_gemv_matches_reference(n: int, k: int) -> None:
    """Batch-1 W8A8 through the GEMV (e4m3 x and W, per-token and per-channel scales)."""
    from pagedllm.kernels.gemv import gemv

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    wq, ws = quantize_fp8_rows(w)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    xq, xs = quantize_fp8_rows(x)
    wq, ws, xq, xs = (t.to(DEVICE) for t in (wq, ws.view(-1), xq, xs))
    y = gemv(xq, wq, bias.to(DEVICE), out=torch.empty(1, n, dtype=torch.bfloat16,
                                                       device=DEVICE), x_scale=xs,
             w_scale=ws)
    ref = fp8_linear_reference(xq, xs, wq, ws, bias.to(DEVICE), torch.float32)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
