"""Attention split by whole KV-head groups (``layers/linear.head_partition``): uneven
shares when the KV heads do not divide by the ranks (SmolLM2: 9 query heads in 3 KV
groups at TP=2), replicas when there are fewer KV heads than ranks; the QKV shards and
o_proj's uneven input shares reassemble the dense layers."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear, head_partition


def test_partitions() -> None:
    assert head_partition(9, 3, 2) == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert head_partition(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1),
                                       (6, 2, 1, 1)]
    assert head_partition(4, 4, 1) == [(0, 4, 0, 4)]
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        head_partition(8, 2, 3)


@pytest.mark.parametrize(("heads", "kv", "tp"), [(9, 3, 2), (8, 2, 4), (6, 6, 4)])
def test_uneven_qkv_and_o_proj_equal_dense(heads: int, kv: int, tp: int) -> None:
    torch.manual_seed(0)
    hd, hidden = 4, 12
    q, k, v = (torch.randn(n * hd, hidden) for n in (heads, kv, kv))
    o = torch.randn(hidden, heads * hd)
    x = torch.randn(3, hidden)
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}
    partial = torch.zeros(3, hidden)
    attn = torch.randn(3, heads * hd)  # stands in for the attention output
    for rank in range(tp):
        qkv = QKVParallelLinear(hidden, hd, heads, kv, tp_size=tp, tp_rank=rank)
        for sid, w in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        y = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=1)
        for sid, part in zip("qkv", y):
            parts[sid].append(part)
        sizes = [n * hd for _, n, _, _ in qkv.partition]
        op = RowParallelLinear(heads * hd, hidden, tp_size=tp, tp_rank=rank,
                               input_sizes=sizes)
        op.weight.weight_loader(op.weight, o)
        start = qkv.q_start * hd
        # The local matmul (the all-reduce is the sum below).
        partial += op.quant_method.apply(op, attn[:, start:start + qkv.q_size], None)
    torch.testing.assert_close(torch.cat(parts["q"], 1), x @ q.T)
    # Replicated KV heads appear once per replica: keep each KV head's first copy.
    seen: dict[int, torch.Tensor] = {}
    for rank in range(tp):
        _, _, kv_start, n = head_partition(heads, kv, tp)[rank]
        for j in range(n):
            seen.setdefault(kv_start + j, parts["k"][rank][:, j * hd:(j + 1) * hd])
    torch.testing.assert_close(torch.cat([seen[i] for i in range(kv)], 1), x @ k.T)
    torch.testing.assert_close(partial, attn @ o.T)
