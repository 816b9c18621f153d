"""The linear layers' generic sharded loader (layers/linear.py): every rank's slice of a
fused, tensor-parallel layer, for plain weights and for parameters a quantisation method
registers with packing / per-shard attributes (layers/quantization/base.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.layers.quantization.base import LinearMethodBase, set_weight_attrs


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_shards_reassemble(tp: int) -> None:
    torch.manual_seed(0)
    hidden, hd, nh, nkv = 16, 4, 4, 2
    q, k, v = (torch.randn(n * hd, hidden) for n in (nh, nkv, nkv))
    x = torch.randn(3, hidden)
    outs = []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, hd, nh, nkv, tp_size=tp, tp_rank=rank)
        for sid, w in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, w, sid)
        y = layer(x)
        outs.append(y.split([layer.q_size, layer.kv_size, layer.kv_size], dim=1))
    for i, full in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([o[i] for o in outs], 1), x @ full.T)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_and_row_parallel_equal_dense(tp: int) -> None:
    torch.manual_seed(1)
    gate, up, down = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6, 8)
    x = torch.randn(5, 6)
    partial = []
    for rank in range(tp):
        gu = MergedColumnParallelLinear(6, [8, 8], tp_size=tp, tp_rank=rank)
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        dn = RowParallelLinear(8, 6, tp_size=1)  # the local matmul, reduced by hand
        dn.tp_rank = rank
        h = gu(x)
        g, u = h.chunk(2, dim=1)
        w_local = down.narrow(1, rank * (8 // tp), 8 // tp)
        dn.weight = nn.Parameter(w_local.clone(), requires_grad=False)
        partial.append(dn(g * u))
    ref = ((x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(sum(partial), ref)


def test_shape_mismatch_names_the_shard() -> None:
    layer = QKVParallelLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match="shard 'k'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(12, 16), "k")
    col = ColumnParallelLinear(6, 8)
    with pytest.raises(ValueError, match="column shard"):
        col.weight.weight_loader(col.weight, torch.zeros(9, 6))


class _PackedMethod(LinearMethodBase):
    """A toy method: int8 codes packed 4 per int32 along the output dim, a per-group
    (group 2 on the input dim) scale, and a per-shard scalar -- the attribute
    combinations real methods use."""

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype) -> None:
        out = sum(output_partition_sizes)
        packed = nn.Parameter(torch.zeros(input_size_per_partition, out // 4,
                                          dtype=torch.int32), requires_grad=False)
        set_weight_attrs(packed, {"input_dim": 0, "output_dim": 1, "packed_dim": 1,
                                  "packed_factor": 4})
        scales = nn.Parameter(torch.zeros(out, input_size_per_partition // 2),
                              requires_grad=False)
        set_weight_attrs(scales, {"output_dim": 0, "input_dim": 1})
        shard_scale = nn.Parameter(torch.zeros(len(output_partition_sizes)),
                                   requires_grad=False)
        set_weight_attrs(shard_scale, {"per_shard": True})
        layer.register_parameter("qweight", packed)
        layer.register_parameter("scales", scales)
        layer.register_parameter("shard_scale", shard_scale)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class _ToyConfig:
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return _PackedMethod()


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_grouped_and_per_shard_params(tp: int) -> None:
    gate_q = torch.arange(6 * 2, dtype=torch.int32).reshape(6, 2)  # [in, out/4] packed
    up_q = gate_q + 100
    gate_s, up_s = torch.randn(8, 3), torch.randn(8, 3)
    for rank in range(tp):
        layer = MergedColumnParallelLinear(6, [8, 8], tp_size=tp, tp_rank=rank,
                                           quant_config=_ToyConfig())  # type: ignore[arg-type]
        assert not hasattr(layer, "weight") and layer.unquantized_weight is None
        for sid, (qw, sc, s) in enumerate(((gate_q, gate_s, 2.0), (up_q, up_s, 3.0))):
            layer.qweight.weight_loader(layer.qweight, qw, sid)
            layer.scales.weight_loader(layer.scales, sc, sid)
            layer.shard_scale.weight_loader(layer.shard_scale, torch.tensor(s), sid)
        per = 2 // tp  # packed columns of one shard on one rank
        torch.testing.assert_close(layer.qweight[:, :per], gate_q[:, rank * per:(rank + 1) * per])
        torch.testing.assert_close(layer.qweight[:, per:], up_q[:, rank * per:(rank + 1) * per])
        rows = 8 // tp
        torch.testing.assert_close(layer.scales[rows:], up_s[rank * rows:(rank + 1) * rows])
        assert layer.shard_scale.tolist() == [2.0, 3.0]
    row = RowParallelLinear(6, 8, tp_size=2, tp_rank=1,
                            quant_config=_ToyConfig())  # type: ignore[arg-type]
    full_q = torch.arange(6 * 2, dtype=torch.int32).reshape(6, 2)
    row.qweight.weight_loader(row.qweight, full_q)
    torch.testing.assert_close(row.qweight, full_q[3:])
