"""Test helper: drive a model through the paged KV cache the way the model runner does.

``PagedSession`` owns a KV cache per layer and a *shuffled, non-contiguous* block table per
request, so a wrong block lookup shows up as wrong logits.  ``step`` takes, per request,
the new token ids to process (a whole prompt, a chunk, or a single decode token) and
builds the flattened ``AttentionMetadata`` by hand.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


def build_metadata(ctx_lens: list[int], query_lens: list[int],
                   block_tables: list[list[int]], block_size: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for requests with ``ctx_lens[r]`` cached tokens and ``query_lens[r]`` new
    ones, whose blocks are ``block_tables[r]`` (padded with 0 to a common width)."""
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    width = max(len(b) for b in block_tables)
    tables = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    slots = []
    for c, q, blocks in zip(ctx_lens, query_lens, block_tables):
        for pos in range(c, c + q):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    dev = torch.device(device)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl_t.to(dev), seq_lens=seq_t.to(dev),
        block_tables=tables.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
        query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t, block_size=block_size)


def positions_for(ctx_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, query_lens)])


class PagedSession:
    """Requests sharing one paged KV cache; block ids are handed out in random order."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int,
                 head_dim: int, num_blocks: int = 64, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: torch.device | str = "cpu", kv_entries: int = 2) -> None:
        """``kv_entries``: the caches' leading dimension (2: K and V; 1: MLA's latent)."""
        self.model, self.block_size = model, block_size
        self.device = torch.device(device)
        self.caches = [torch.zeros(kv_entries, num_blocks, block_size, num_kv_heads, head_dim,
                                   dtype=dtype, device=self.device)
                       for _ in range(num_layers)]
        model.bind_kv_caches(self.caches)  # type: ignore[operator]
        g = torch.Generator().manual_seed(seed)
        # Block 0 is kept as padding/null, like the real block pool.
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]],
             last_only: bool = False) -> dict[int, torch.Tensor]:
        """Process ``new_tokens[req]`` for each request; returns each request's logits for
        all its new tokens (``[q, vocab]`` float32), or with ``last_only`` (the model's
        forward flag) for its last new token only (``[1, vocab]``)."""
        reqs = list(new_tokens)
        ctx, qlens = [], []
        for r in reqs:
            c = self.lens.get(r, 0)
            q = len(new_tokens[r])
            table = self.tables.setdefault(r, [])
            while len(table) * self.block_size < c + q:
                table.append(self.free.pop())
            ctx.append(c)
            qlens.append(q)
        meta = build_metadata(ctx, qlens, [self.tables[r] for r in reqs], self.block_size,
                              self.device)
        ids = torch.tensor([t for r in reqs for t in new_tokens[r]], dtype=torch.long,
                           device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, positions_for(ctx, qlens).to(self.device), meta,
                                last_only=last_only)
            logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        out, start = {}, 0
        for i, (r, c, q) in enumerate(zip(reqs, ctx, qlens)):
            out[r] = logits[i:i + 1] if last_only else logits[start:start + q]
            start += q
            self.lens[r] = c + q
        return out


def session_for(pair, block_size: int = 16, seed: int = 0) -> PagedSession:  # type: ignore[no-untyped-def]
    """A ``PagedSession`` (48 blocks) on ``pair = (our model, hf model, engine config)``,
    the fixture shape the HF-parity tests share."""
    ours, _, cfg = pair
    mc = cfg.model_config
    return PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48,
                        block_size=block_size, seed=seed, kv_entries=mc.kv_entries_per_token)


def hf_logits_of(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Transformers' float32 logits of one unbatched prompt."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()
