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

Per-token key limits (``AttentionMetadata.query_limits``, an image run that attends to
itself) widen the chunks' causal mask to ``key <= limit``; decodes never have one.

Attention kinds (``attention/kinds.py``): a sliding window narrows the boolean mask
(``key > query - W``; blocks outside the window may be the null block, as masked
keys are never read into the softmax); a logit
soft-cap replaces SDPA by the explicit ``softmax(c * tanh(q k^T * scale / c))`` in the
same order of operations as transformers' eager attention.

An fp8 cache (``attention/kv_cache_dtype.py``) stores ``k / k_scale`` and ``v / v_scale``
in e4m3; the gathered blocks are upcast and rescaled to the query's dtype before SDPA.

Sizes come from the ``*_cpu`` metadata, so the backend never syncs the device; it works
for float32, bfloat16 and float16 on CPU and CUDA.  The batch's structure (which requests
decode, their sizes, the decode mask) is worked out once per step and reused by every
layer (``_plan``), since on a small CPU model those few dozen tiny ops per layer cost as
much as the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kinds import FULL, AttentionKind
from pagedllm.attention.kv_cache_dtype import is_fp8, quantize_kv
from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class _Plan:
    """Per-step structure of the batch, derived from the host metadata only."""

    qsl: torch.Tensor  # clones of the host tensors the plan was made from
    seq_lens: torch.Tensor
    num_decodes: int
    all_decode: bool
    decode_rows: torch.Tensor | None  # device; None when all requests decode
    decode_tokens: torch.Tensor | None  # device; token index of each decode
    decode_blocks: int  # blocks to gather per decode request
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend
    chunks: list[tuple[int, int, int, int]]  # (row, start, end, seq_len), query_len > 1
    decode_seq: torch.Tensor | None = None  # device [B] seq_len of each decode
    window_masks: dict[int, torch.Tensor] | None = None  # sliding window -> decode mask


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, kind: AttentionKind, causal: bool = False,
               gqa: bool = False) -> torch.Tensor:
    """SDPA, or with a logit soft-cap the explicit computation (transformers' eager
    order: scores * scale, cap, mask, float32 softmax, P @ V).  ``q [.., Hq, Lq, D]``,
    ``k/v [.., Hk, Lk, D]``; ``mask`` True = attend."""
    cap = kind.logits_soft_cap
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class _Dequant:
    """One layer's key (or value) cache as attention reads it: gathered blocks in the
    query's dtype, rescaled when the cache is fp8."""

    def __init__(self, cache: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
        self.cache, self.scale, self.dtype = cache, scale, dtype
        self.shape = cache.shape

    def gather(self, blocks: torch.Tensor) -> torch.Tensor:
        x = self.cache.index_select(0, blocks)
        if is_fp8(self.cache):
            x = x.to(self.dtype) if self.scale == 1.0 else (x.float() * self.scale).to(
                self.dtype)
        return x


class TorchReferenceBackend(AttentionBackend):
    """Paged attention in plain PyTorch (``scaled_dot_product_attention``).

    Holds no per-request state; it caches the plan of the last metadata object it saw
    (checked by identity *and* by the host tensors' contents, so a runner that reuses one
    metadata object and rewrites it in place still gets a fresh plan).
    """

    name = "torch"
    kv_cache_dtypes = ("auto", "fp8")

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan_cache: _Plan | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
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
        if is_fp8(kv_cache):
            # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
            kv = kv.view(torch.uint8)
            key = quantize_kv(key, k_scale).view(torch.uint8)
            value = quantize_kv(value, v_scale).view(torch.uint8)
        kv[0].index_copy_(0, slots, key.to(kv.dtype))
        kv[1].index_copy_(0, slots, value.to(kv.dtype))

    def _plan(self, meta: AttentionMetadata, block_size: int,
              device: torch.device) -> _Plan:
        qsl = meta.query_start_loc_cpu[:meta.num_reqs + 1]
        seq_lens = meta.seq_lens_cpu[:meta.num_reqs]
        cached = self._plan_cache
        # The plan does not read block tables, so KV cache groups' metadata (which share
        # everything else: ``AttentionMetadata.kv_groups``) share one plan.
        if (cached is not None and self._meta is not None
                and self._meta.seq_lens is meta.seq_lens and torch.equal(cached.qsl, qsl)
                and torch.equal(cached.seq_lens, seq_lens)):
            return cached
        query_lens = qsl[1:] - qsl[:-1]
        is_decode = query_lens == 1
        num_decodes = int(is_decode.sum())
        all_decode = num_decodes == meta.num_reqs
        rows = tokens = mask = None
        nblk = 0
        if num_decodes:
            dec_seq = seq_lens if all_decode else seq_lens[is_decode]
            nblk = -(-int(dec_seq.max()) // block_size)
            dev_seq = meta.seq_lens[:meta.num_reqs]
            if not all_decode:
                rows_cpu = torch.nonzero(is_decode).flatten()
                rows = rows_cpu.to(device)
                tokens = qsl[:-1][rows_cpu].to(device=device, dtype=torch.long)
                dev_seq = dev_seq.index_select(0, rows)
            mask = torch.arange(nblk * block_size, device=device) < dev_seq.unsqueeze(1)
            mask = mask[:, None, None, :]
        chunks = []
        for r in torch.nonzero(query_lens > 1).flatten().tolist():
            chunks.append((r, int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])))
        plan = _Plan(qsl.clone(), seq_lens.clone(), num_decodes, all_decode, rows, tokens,
                     nblk, mask, chunks, dev_seq if num_decodes else None, {})
        self._meta, self._plan_cache = meta, plan
        return plan

    def supports(self, kind: AttentionKind) -> bool:
        return True  # full, sliding window, soft-capped

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kind: AttentionKind = FULL, k_scale: float = 1.0,
               v_scale: float = 1.0, decodes: bool = True) -> torch.Tensor:
        """``decodes`` False: the rows of one-token requests in a mixed step are left
        unset (a caller that computes them itself: ``cpu_backend.py``)."""
        if meta.num_reqs == 0 or meta.num_actual_tokens == 0:
            return torch.empty_like(query)
        k_cache = _Dequant(kv_cache[0], k_scale, query.dtype)
        v_cache = _Dequant(kv_cache[1], v_scale, query.dtype)
        bs = kv_cache.shape[2]
        plan = self._plan(meta, bs, query.device)
        if plan.all_decode and plan.num_decodes == query.shape[0]:
            return self._decodes(query, k_cache, v_cache, meta, plan, scale, kind)  # no copy
        out = torch.empty_like(query)
        if plan.num_decodes and decodes:
            o = self._decodes(query, k_cache, v_cache, meta, plan, scale, kind)
            if plan.decode_tokens is None:
                out[:plan.num_decodes] = o
            else:
                out[plan.decode_tokens] = o
        gqa = query.shape[1] != kv_cache.shape[3]
        for r, start, end, seq_len in plan.chunks:
            ctx = seq_len - (end - start)
            blocks = meta.block_tables[r, :-(-seq_len // bs)]
            # [nblk, bs, H, D] -> [1, H, seq_len, D]
            k = k_cache.gather(blocks).flatten(0, 1)[:seq_len]
            v = v_cache.gather(blocks).flatten(0, 1)[:seq_len]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            window = kind.sliding_window
            limits = meta.query_limits
            if ctx == 0 and (window is None or window >= seq_len) and limits is None:
                o = _attention(q, k, v, None, scale, kind, causal=True, gqa=gqa)
            else:
                # Query i sits at position ctx + i and sees keys 0..ctx + i, or up to its
                # ``query_limits`` (metadata.py); the last W of positions <= ctx + i
                # and every later one with a sliding window.
                qpos = torch.arange(ctx, seq_len, device=query.device).unsqueeze(1)
                kpos = torch.arange(seq_len, device=query.device).unsqueeze(0)
                mask = kpos <= (qpos if limits is None else
                                limits[start:end].unsqueeze(1).to(qpos.dtype))
                if window is not None:
                    mask &= kpos > qpos - window
                o = _attention(q, k, v, mask, scale, kind, gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode_mask(plan: _Plan, kind: AttentionKind, length: int) -> torch.Tensor | None:
        """The decode mask for ``kind``: keys ``< seq_len``, and with a window ``W`` also
        ``>= seq_len - W`` (the query is at ``seq_len - 1``); cached per window."""
        window = kind.sliding_window
        if window is None or plan.decode_seq is None or plan.window_masks is None:
            return plan.decode_mask
        if window not in plan.window_masks:
            kpos = torch.arange(length, device=plan.decode_seq.device)
            seq = plan.decode_seq.unsqueeze(1)
            plan.window_masks[window] = ((kpos < seq) & (kpos >= seq - window))[:, None,
                                                                               None, :]
        return plan.window_masks[window]

    @staticmethod
    def _decodes(query: torch.Tensor, k_cache: _Dequant, v_cache: _Dequant,
                 meta: AttentionMetadata, plan: _Plan, scale: float,
                 kind: AttentionKind = FULL) -> torch.Tensor:
        """All single-token queries at once: ``[B, Hk, G, D]`` against ``[B, Hk, L, D]``;
        returns ``[B, H, D]`` in decode order."""
        b = plan.num_decodes
        if plan.decode_rows is None:
            tables = meta.block_tables[:b, :plan.decode_blocks]
            q = query[:b]
        else:
            tables = meta.block_tables.index_select(0, plan.decode_rows)
            tables = tables[:, :plan.decode_blocks]
            q = query[plan.decode_tokens]
        length = plan.decode_blocks * k_cache.shape[1]
        h_kv, d = k_cache.shape[2], k_cache.shape[3]
        # index_select over the flattened table is a row memcpy; ``k_cache[tables]`` with a
        # 2-D index goes through the generic (several times slower) index kernel.
        flat = tables.reshape(-1)
        k = k_cache.gather(flat).view(b, length, h_kv, d).transpose(1, 2)
        v = v_cache.gather(flat).view(b, length, h_kv, d).transpose(1, 2)
        # GQA without expanding K/V: the G query heads sharing a KV head become G "query
        # rows" of that head (HF's repeat_kv maps query head h to KV head h // G).
        group = q.shape[1] // h_kv
        mask = TorchReferenceBackend._decode_mask(plan, kind, length)
        o = _attention(q.view(b, h_kv, group, d), k, v, mask, scale, kind)
        return o.reshape(b, h_kv * group, d)
