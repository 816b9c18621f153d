"""The pure-PyTorch paged attention backend: the CPU backend and the oracle for every
GPU kernel.

Per step it does, for the flattened batch described in ``metadata.py``:

```
 write_kv:  k_cache.view(num_blocks * block_size, H, D)[slot_mapping[t]] = key[t]
 attend:    decodes (query_len == 1)  -> one batched SDPA over gathered blocks
            chunks  (query_len  > 1)  -> one SDPA per request, causal with a context offset
```

Gathering: ``k_cache[block_tables[r, :n]]`` gives ``[n, block_size, H, D]``, i.e. the
request's keys in position order (position p lives at block ``p // bs``, offset
``p % bs``).  Positions ``>= seq_len`` in the last block are masked with a boolean mask
(never an additive ``-inf`` row: every valid query sees at least key 0, so no softmax row
is empty and nothing becomes NaN).

Sizes come from the ``*_cpu`` metadata, so the backend never syncs the device; it works
for float32, bfloat16 and float16 on CPU and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    """Paged attention in plain PyTorch (``scaled_dot_product_attention``)."""

    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        n = meta.num_actual_tokens
        if n == 0:
            return
        _, nb, bs, h, d = kv_cache.shape
        slots = meta.slot_mapping[:n]
        key, value = key[:n], value[:n]
        # Slot -1 marks a token whose KV must not be written.  Filtering is a cheap
        # boolean index on CPU (a sync on CUDA, which is fine for an oracle).
        valid = slots >= 0
        if kv_cache.device.type != "cpu" or not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        kv = kv_cache.view(2, nb * bs, h, d)
        kv[0].index_copy_(0, slots, key.to(kv_cache.dtype))
        kv[1].index_copy_(0, slots, value.to(kv_cache.dtype))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.num_reqs == 0 or meta.num_actual_tokens == 0:
            return out
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        qsl = meta.query_start_loc_cpu[:meta.num_reqs + 1]
        seq_lens = meta.seq_lens_cpu[:meta.num_reqs]
        query_lens = qsl[1:] - qsl[:-1]
        bs = kv_cache.shape[2]
        gqa = query.shape[1] != kv_cache.shape[3]

        is_decode = query_lens == 1
        if bool(is_decode.any()):
            self._decodes(query, out, k_cache, v_cache, meta, is_decode, scale)
        for r in torch.nonzero(~is_decode & (query_lens > 0)).flatten().tolist():
            start, end = int(qsl[r]), int(qsl[r + 1])
            seq_len = int(seq_lens[r])
            ctx = seq_len - (end - start)
            nblk = -(-seq_len // bs)
            blocks = meta.block_tables[r, :nblk]
            # [nblk, bs, H, D] -> [1, H, seq_len, D]
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            if ctx == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
            else:
                # Query i sits at position ctx + i and sees keys 0..ctx + i.
                qpos = torch.arange(ctx, seq_len, device=query.device).unsqueeze(1)
                kpos = torch.arange(seq_len, device=query.device).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=kpos <= qpos,
                                                   scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decodes(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, is_decode: torch.Tensor,
                 scale: float) -> None:
        """All single-token queries at once: ``[B, H, 1, D]`` against ``[B, H, L, D]``."""
        bs = k_cache.shape[1]
        qsl = meta.query_start_loc_cpu
        all_decode = bool(is_decode.all())
        if all_decode:  # the steady state: no index juggling
            rows_cpu = None
            seq_lens_cpu = meta.seq_lens_cpu[:meta.num_reqs]
            seq_lens = meta.seq_lens[:meta.num_reqs]
            tables = meta.block_tables[:meta.num_reqs]
            tok_idx = None
        else:
            rows_cpu = torch.nonzero(is_decode).flatten()
            seq_lens_cpu = meta.seq_lens_cpu[rows_cpu]
            rows = rows_cpu.to(query.device)
            seq_lens = meta.seq_lens.index_select(0, rows)
            tables = meta.block_tables.index_select(0, rows)
            tok_idx = qsl[:-1][rows_cpu].to(device=query.device, dtype=torch.long)
        max_len = int(seq_lens_cpu.max())
        nblk = -(-max_len // bs)
        tables = tables[:, :nblk]
        b = tables.shape[0]
        length = nblk * bs
        h_kv, d = k_cache.shape[2], k_cache.shape[3]
        # index_select over the flattened table is a row memcpy; ``k_cache[tables]`` with a
        # 2-D index goes through the generic (several times slower) index kernel.
        flat = tables.reshape(-1)
        k = k_cache.index_select(0, flat).view(b, length, h_kv, d).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(b, length, h_kv, d).transpose(1, 2)
        q = query[:b] if tok_idx is None else query[tok_idx]
        # GQA without expanding K/V: the G query heads sharing a KV head become G "query
        # rows" of that head (HF's repeat_kv maps query head h to KV head h // G).
        group = q.shape[1] // h_kv
        q = q.view(b, h_kv, group, d)
        mask = torch.arange(length, device=query.device) < seq_lens.unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale)
        o = o.reshape(b, h_kv * group, d)
        if tok_idx is None:
            out[:b] = o
        else:
            out[tok_idx] = o
