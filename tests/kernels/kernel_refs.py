"""Shared helpers for the kernel tests: device choice, naive torch references, and
builders for random paged-attention batches.

The references here are deliberately the simplest possible code (dense per-request
attention, a python loop over requests) so that they are obviously right.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"

# Tolerances for attention outputs against an fp32 reference: |err| <= atol + rtol*|ref|.
# bf16's rtol covers output rounding (the interpreter truncates instead of rounding, so a
# full ulp, 2**-7) plus P rounded to bf16 before P@V.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int,
                 scale: float = 1.0) -> None:
    """``got`` (any device/dtype) vs fp32 ``ref``; NaN anywhere fails (poisoned rows).
    ``scale`` widens both tolerances (e.g. 2 when ``ref`` is itself rounded)."""
    got = got.float().cpu()
    ref = ref.float().cpu()
    assert not got.isnan().any(), f"NaN / unwritten rows (seed={seed})"
    excess = (got - ref).abs() - scale * (ATOL[dtype] + RTOL[dtype] * ref.abs())
    worst = excess.max().item()
    assert worst <= 0, (f"tolerance exceeded by {worst} (max abs err "
                        f"{(got - ref).abs().max().item()}, seed={seed})")


@dataclass
class PagedBatch:
    """A random mixed batch laid out exactly as AttentionMetadata describes."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D] new keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, NB, BS, KVH, D], context + new tokens already written
    block_tables: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    slot_mapping: torch.Tensor  # [T] int64
    ctx_k: list[torch.Tensor]  # per request, [seq_len, KVH, D] all keys (dense truth)
    ctx_v: list[torch.Tensor]
    query_lens: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


def make_paged_batch(
    query_lens: list[int], ctx_lens: list[int], *, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype, device: str,
    num_blocks: int | None = None, pad_tokens: int = 0, gen: torch.Generator | None = None,
) -> PagedBatch:
    """Requests with ``ctx_lens[i]`` cached tokens and ``query_lens[i]`` new ones.

    Blocks are drawn as a random permutation of the pool (so block tables are
    scattered, and high block ids are used when the pool is large).  The cache is
    filled with the context *and* the new tokens; ``key``/``value`` hold the new ones
    so write tests can clear and rewrite them.  ``pad_tokens`` adds padding tokens
    (slot -1) after the last request, like a CUDA-graph batch.
    """
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks_per = [(s + block_size - 1) // block_size for s in seq_lens]
    total_blocks = sum(blocks_per)
    num_blocks = max(num_blocks or 0, total_blocks + 1)
    perm = torch.randperm(num_blocks, generator=gen)[:total_blocks].tolist()
    max_blocks = max(blocks_per)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    ctx_k, ctx_v, new_k, new_v, slots, queries = [], [], [], [], [], []
    qsl = [0]
    used = 0
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        ids = perm[used:used + blocks_per[r]]
        used += blocks_per[r]
        block_tables[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(s)
        blk = torch.tensor(ids, dtype=torch.int64)[pos // block_size]
        off = pos % block_size
        ctx_k.append(kv_cache[0, blk, off].float())
        ctx_v.append(kv_cache[1, blk, off].float())
        new_k.append(kv_cache[0, blk[s - q:], off[s - q:]])
        new_v.append(kv_cache[1, blk[s - q:], off[s - q:]])
        slots.append(blk[s - q:] * block_size + off[s - q:])
        queries.append(torch.randn(q, num_heads, head_dim, generator=gen))
        qsl.append(qsl[-1] + q)
    if pad_tokens:
        queries.append(torch.randn(pad_tokens, num_heads, head_dim, generator=gen))
        new_k.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
        new_v.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
        slots.append(torch.full((pad_tokens,), -1, dtype=torch.int64))
    dev = torch.device(device)
    return PagedBatch(
        query=torch.cat(queries).to(dtype).to(dev),
        key=torch.cat(new_k).to(dev), value=torch.cat(new_v).to(dev),
        kv_cache=kv_cache.to(dev), block_tables=block_tables.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        slot_mapping=torch.cat(slots).to(dev),
        ctx_k=ctx_k, ctx_v=ctx_v, query_lens=list(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Dense fp32 causal attention per request; rows of padding tokens are NaN."""
    q_all = batch.query.float().cpu()
    out = torch.full_like(q_all, float("nan"))
    num_heads = q_all.shape[1]
    start = 0
    for r, q_len in enumerate(batch.query_lens):
        k = batch.ctx_k[r].cpu()
        v = batch.ctx_v[r].cpu()
        s_len = k.shape[0]
        gqa = num_heads // k.shape[1]
        k = k.repeat_interleave(gqa, dim=1)  # [S, H, D]
        v = v.repeat_interleave(gqa, dim=1)
        q = q_all[start:start + q_len]  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        mask = torch.arange(s_len)[None, :] <= q_pos  # [Q, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def fresh_seed() -> int:
    """A new seed per test run (inputs are fresh each run); tests print it on failure."""
    return int.from_bytes(os.urandom(4), "little")


def random_mixed_lens(gen: torch.Generator, *, num_decodes: int, num_chunks: int,
                      max_ctx: int, max_chunk: int) -> tuple[list[int], list[int]]:
    """Shuffled (query_lens, ctx_lens): decodes (1 new token after 1..max_ctx cached),
    prefill chunks with cached context, and one fresh prompt (no context)."""
    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    reqs = [(1, rint(1, max_ctx)) for _ in range(num_decodes)]
    reqs += [(rint(2, max_chunk), rint(1, max_ctx)) for _ in range(num_chunks)]
    reqs.append((rint(2, max_chunk), 0))
    order = torch.randperm(len(reqs), generator=gen).tolist()
    return [reqs[i][0] for i in order], [reqs[i][1] for i in order]
