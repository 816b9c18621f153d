"""The Triton FP8 GEMM for decode-sized batches (kernels/fp8_gemm.py) against the
upcasting reference (layers/quantization/fp8.fp8_linear_reference), its routing table,
and on a GPU the FP8 linear layer routed through it at Llama-3-8B shapes."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_refs import DEVICE, ON_GPU

from pagedllm.kernels import fp8_gemm as fg
from pagedllm.kernels.quant_common import quantize_fp8_rows
from pagedllm.layers.quantization.fp8 import fp8_linear_reference


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0] = 0.0  # a zero token: its scale at the floor, a zero output row
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])  # a row that saturates its scale
    x_q, x_s = quantize_fp8_rows(x)
    w_q, w_s = quantize_fp8_rows(w)
    bias = torch.randn(n, generator=g)
    return (x_q.to(DEVICE), x_s.to(DEVICE), w_q.to(DEVICE), w_s.reshape(-1).to(DEVICE),
            bias.to(DEVICE))


# (block_m, block_n, block_k, warps, stages, split, swap): the rows as wgmma's N
# dimension and plain, one K chunk and split-K (with a split that does not divide K's
# steps, so the last chunk runs past K), tiles wider than M and N.
CONFIGS = [(16, 32, 64, 4, 2, 1, 1), (32, 64, 64, 4, 2, 3, 1), (16, 16, 64, 4, 2, 2, 0),
           (64, 32, 128, 4, 2, 1, 0)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mnk", [(5, 48, 256), (33, 40, 384)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_matches_reference(config, mnk, with_bias: bool) -> None:
    m, n, k = mnk
    if k % config[2]:
        pytest.skip("K must be a multiple of block_k")
    x_q, x_s, w_q, w_s, bias = _operands(m, n, k, seed=m + n + k)
    b = bias.to(torch.bfloat16) if with_bias else None
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fg.fp8_gemm(x_q, x_s, w_q, w_s, b, out_dtype, config)
        ref = fp8_linear_reference(x_q, x_s, w_q, w_s, b, torch.float32)
        assert got.dtype == out_dtype and got.shape == (m, n)
        # fp32 sums of the same e4m3 products in another order, one rounding at the end;
        # on Hopper the tensor cores sum each K step's FP8 products with fewer mantissa
        # bits before they join the fp32 accumulator (measured: 3.8e-5 of the largest).
        tol = 2 ** -8 if out_dtype != torch.float32 else 5e-4 if ON_GPU else 1e-5
        err = (got.float() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item() + 1e-6, (config, out_dtype, err)
        assert torch.all(got[0].float() == (b.float() if with_bias else 0.0))


def test_fp8_gemm_rejects_bad_operands() -> None:
    x_q, x_s, w_q, w_s, _ = _operands(4, 32, 96, seed=1)
    with pytest.raises(ValueError, match="multiple of block_k"):
        fg.fp8_gemm(x_q, x_s, w_q, w_s, None, torch.bfloat16, (16, 32, 64, 4, 2, 1, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fg.fp8_gemm(x_q.float(), x_s, w_q, w_s, None, torch.bfloat16,
                    (16, 32, 32, 4, 2, 1, 1))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[N, K\]"):
        fg.fp8_gemm(x_q, x_s, w_q[:, :64], w_s, None, torch.bfloat16,
                    (16, 32, 32, 4, 2, 1, 1))


def test_route_follows_the_table(tmp_path, monkeypatch) -> None:
    """An entry serves every M up to its m at its (n, k); above the table's largest m, at
    other shapes and without a table, cuBLASLt (None)."""
    cfg_a, cfg_b = [16, 64, 128, 4, 4, 8, 1], [64, 128, 128, 4, 4, 2, 1]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": [
        [16, 4096, 4096, "triton", cfg_a], [64, 4096, 4096, "triton", cfg_b],
        [128, 4096, 4096, "cublas", None]]}))

    def fresh() -> None:
        fg._table.cache_clear()
        fg.fp8_gemm_route.cache_clear()

    monkeypatch.setenv("PAGEDLLM_FP8_GEMM_CONFIGS", str(path))
    fresh()
    assert fg.fp8_gemm_route(2, 4096, 4096) == tuple(cfg_a)
    assert fg.fp8_gemm_route(16, 4096, 4096) == tuple(cfg_a)
    assert fg.fp8_gemm_route(17, 4096, 4096) == tuple(cfg_b)
    assert fg.fp8_gemm_route(100, 4096, 4096) is None
    assert fg.fp8_gemm_route(4096, 4096, 4096) is None
    assert fg.fp8_gemm_route(16, 6144, 4096) is None
    path.write_text(json.dumps({"configs": [[16, 4096, 4096, "cutlass", None]]}))
    fresh()
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_GEMM_CONFIGS: unknown path"):
        fg.fp8_gemm_route(2, 4096, 4096)
    monkeypatch.setenv("PAGEDLLM_FP8_GEMM_CONFIGS", str(tmp_path / "missing.json"))
    fresh()
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_GEMM_CONFIGS: cannot read"):
        fg.fp8_gemm_route(2, 4096, 4096)
    monkeypatch.delenv("PAGEDLLM_FP8_GEMM_CONFIGS")
    fresh()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
def test_shipped_table_configs_at_llama_shapes() -> None:
    """Every configuration the shipped table routes to, at its m and at a smaller odd M,
    against the reference at the Llama-3-8B projection shapes."""
    fg._table.cache_clear()
    table = fg._table()
    if not table:
        pytest.skip("no shipped table for this GPU")
    for (n, k), entries in table.items():
        for m, cfg in entries:
            if cfg is None:
                continue
            for rows in {m, max(1, m - 3)}:
                x_q, x_s, w_q, w_s, _ = _operands(rows, n, k, seed=rows)
                got = fg.fp8_gemm(x_q, x_s, w_q, w_s, None, torch.bfloat16, cfg)
                ref = fp8_linear_reference(x_q, x_s, w_q, w_s, None, torch.float32)
                err = (got.float() - ref).abs().max().item()
                assert err <= 2 ** -7 * ref.abs().max().item(), (n, k, rows, cfg, err)


def test_routing_summary_names_the_table(tmp_path, monkeypatch) -> None:
    """The start-up log's line: the table's file and reach, or cuBLASLt without one."""
    path = tmp_path / "fp8_gemm_X.json"
    path.write_text(json.dumps({"configs": [
        [16, 4096, 4096, "triton", [16, 64, 128, 4, 4, 8, 1]],
        [64, 4096, 4096, "cublas", None],
        [32, 6144, 4096, "triton", [32, 64, 128, 4, 4, 2, 1]]]}))
    monkeypatch.setenv("PAGEDLLM_FP8_GEMM_CONFIGS", str(path))
    fg._table.cache_clear()
    assert fg.routing_summary() == ("FP8 GEMMs: Triton up to 32 rows at 2 weight shapes "
                                    "(fp8_gemm_X.json), cuBLASLt otherwise")
    path.write_text(json.dumps({"configs": []}))
    fg._table.cache_clear()
    assert fg.routing_summary().startswith("FP8 GEMMs: cuBLASLt from 2 rows (no Triton")
    monkeypatch.delenv("PAGEDLLM_FP8_GEMM_CONFIGS")
    fg._table.cache_clear()
