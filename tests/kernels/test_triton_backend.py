"""TritonAttentionBackend through the AttentionMetadata contract: write this step's K/V,
then attend over cached context + new tokens, against the naive reference and (when it
is in the tree) TorchReferenceBackend."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_refs import DEVICE, assert_close, fresh_seed, make_paged_batch, naive_attention

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_backend import TritonAttentionBackend


def _torch_reference_backend() -> object | None:
    try:
        mod = importlib.import_module("pagedllm.attention.torch_ref")
    except ImportError:
        return None
    cls = getattr(mod, "TorchReferenceBackend", None)
    return cls() if cls is not None else None


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_forward(dtype: torch.dtype, splits: int | None) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [1, 6, 1, 9], [33, 17, 2, 0]
    if splits is None:  # decode-only batch: the heuristic picks split-KV by itself
        q_lens, ctx_lens = [1, 1, 1], [40, 3, 70]
    batch = make_paged_batch(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, dtype=dtype, device=DEVICE, pad_tokens=2,
                             gen=gen)
    n = sum(q_lens)
    qsl = batch.query_start_loc.cpu()
    meta = AttentionMetadata(
        num_actual_tokens=n, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping, query_start_loc_cpu=qsl,
        seq_lens_cpu=batch.seq_lens.cpu(), block_size=16)
    # Clear the new tokens' slots so the test proves forward() writes them first.
    cache = batch.kv_cache.clone()
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[:, batch.slot_mapping[:n]] = 0.0
    ref_cache = cache.clone()
    backend = TritonAttentionBackend(force_num_splits=splits)
    out = backend.forward(batch.query, batch.key, batch.value, cache, meta, 0.125)
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert torch.equal(cache, batch.kv_cache), f"seed={seed}"
    assert_close(out[:n], naive_attention(batch, 0.125)[:n], dtype, seed)

    oracle = _torch_reference_backend()
    if oracle is not None:
        ref2 = oracle.forward(batch.query, batch.key, batch.value, ref_cache, meta, 0.125)
        assert_close(out[:n], ref2[:n], dtype, seed, scale=2.0)  # ref2 is rounded too


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_replay_and_no_sync() -> None:
    """Capture a decode step (write + attend, split path) in a CUDA graph with short
    contexts, then replay after rewriting the metadata tensors for much longer contexts:
    the output must follow the new lengths.  The eager call runs under sync-debug
    'error' to prove it never syncs the host."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    bs, ctx = 8, 3000
    batch = make_paged_batch([1] * bs, [ctx] * bs, num_heads=32, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=torch.bfloat16,
                             device=DEVICE, gen=gen)
    short = torch.full((bs,), 50, dtype=torch.int32, device=DEVICE)
    seq_lens = batch.seq_lens.clone()
    meta = AttentionMetadata(
        num_actual_tokens=bs, num_reqs=bs, max_query_len=1, max_seq_len=50,
        query_start_loc=batch.query_start_loc, seq_lens=short,
        block_tables=batch.block_tables, slot_mapping=batch.slot_mapping,
        query_start_loc_cpu=batch.query_start_loc.cpu(), seq_lens_cpu=short.cpu(),
        block_size=16)
    backend = TritonAttentionBackend()
    cache = batch.kv_cache
    # slot_mapping points at the last position of the long context; writing there while
    # seq_lens is short is harmless for this test (it rewrites the same values).
    backend.forward(batch.query, batch.key, batch.value, cache, meta, 0.1)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(batch.query, batch.key, batch.value, cache, meta, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(batch.query, batch.key, batch.value, cache, meta, 0.1)
    short.copy_(seq_lens)  # now the real (long) contexts
    graph.replay()
    assert_close(out, naive_attention(batch, 0.1), torch.bfloat16, seed)
