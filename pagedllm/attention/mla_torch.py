"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent KV cache, in
plain PyTorch: the CPU backend and the oracle for the GPU decode kernel
(``kernels/mla_decode.py``).

KV cache layout, one tensor per layer (``ModelConfig.kv_entries_per_token`` = 1)::

    [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]   model dtype, or e4m3
                                   └─ per token: [ c_kv (after kv_a_layernorm) | k_pe (after RoPE) ]

The leading 1 stands where GQA's ``[2, ...]`` has keys and values, so block moves
(``cache[:, block_ids]``: swap, copy-on-write) are the same code for both.  Block tables,
slot mapping and the flattened batch are ``metadata.py``'s, as for the GQA backends.

Per head ``h`` the layer's ``kv_b_proj`` weight ``[H * (Dn + Dv), L]`` holds ``W_UK[h]``
(``[Dn, L]``: latent -> no-RoPE key) and ``W_UV[h]`` (``[Dv, L]``: latent -> value).
Attention has two equal forms (to rounding):

```
 expanded (prefill, chunks):  k_nope, v = kv_b_proj(c_kv)     per context token and head
                              scores    = q_nope.k_nope + q_pe.k_pe;  out = P v        [T,H,Dv]
 absorbed (decode):           q_lat     = q_nope W_UK[h]       (query into latent space)
                              scores    = q_lat.c_kv + q_pe.k_pe;     o_lat = P c_kv   [T,H,L]
                              out       = o_lat W_UV[h]^T                              [T,H,Dv]
```

The absorbed form reads ``L + R`` elements per context token (once for all heads)
instead of up-projecting the whole context every step: it is what decode uses.  The
expanded form does ``H * (Dn + Dv)`` work per context token once, and suits long query
runs.  ``MLAMode`` picks, by shapes only: in ``"auto"`` one-token requests (decodes)
take the absorbed form and longer ones the expanded form; ``"absorbed"`` /
``"expanded"`` force one for every request (tests).  On CUDA a decode-only step calls
the Triton kernel ``kernels/mla_decode.py`` when it exists.

On CUDA the expanded form gathers every request's context in one ``index_select``
(token slots computed from the block tables: no loop over requests), runs one
``kv_b_proj`` GEMM, and one launch of the varlen kernel ``kernels/mla_prefill.py`` for
the whole step (``k_pe`` never expanded; Dv != Dn + R is no obstacle there, as it is to
FlashAttention).  It replaced one SDPA per request, which stays the CPU's path (and the
fallback without Triton): on an H200, DeepSeek-V2-Lite's W4 TTFT was 39.8 ms with the
kernel against 44.9 ms with SDPA (2026-12-05).  The CPU runs the kernel only when a test
sets ``kernel_on_cpu``.

Positions ``>= seq_len`` in a request's last block are masked with a boolean mask; sizes
come from the ``*_cpu`` metadata, so nothing syncs the device.

An fp8 cache (``kv_cache_dtype="fp8"``, ``attention/kv_cache_dtype.py``) stores the whole
entry as ``[c_kv | k_pe] / k_scale`` rounded to e4m3 and saturated at +-448 (half the
bytes of bf16: V2-Lite's 576-element entry is 576 bytes a token and layer).  One scale
per layer, the layer's ``k_scale`` (vLLM's convention for the latent cache): 1.0, a
checkpoint's ``self_attn.k_scale``, or ``--calculate-kv-scales``' ``amax / 200`` over the
first batch's entries (``layers/mla.py``).  Every read dequantises (``* k_scale``): the
expanded form and the torch absorbed paths into the query's dtype as they gather, the
Triton decode kernel in its registers (``kernels/mla_decode.py``).  Gathers and the write
move fp8 entries as bytes (fp8 has no ``index_copy_`` kernel on the CPU).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from pagedllm.attention.kv_cache_dtype import is_fp8, quantize_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs

MLAMode = Literal["auto", "absorbed", "expanded"]
MLA_MODES: tuple[str, ...] = ("auto", "absorbed", "expanded")


@dataclass(frozen=True)
class MLADims:
    """One MLA layer's sizes (``H`` = heads on this rank)."""

    num_heads: int
    kv_lora_rank: int  # L
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # R
    v_head_dim: int  # Dv

    @property
    def entry(self) -> int:
        """Elements per token in the cache: ``L + R``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class _ContextIndex:
    """Where the expanded rows' contexts are, on the device (host-derived, once a step):
    context token ``j`` of the concatenation is position ``col[j] * block_size +
    off[j]`` of request row ``req[j]``; ``cu_k [num_reqs + 1]`` int32 gives each row's
    range in the concatenation (empty for rows not expanded)."""

    rows: tuple[int, ...]  # the expanded request rows (the cache key)
    req: torch.Tensor  # [S] int64
    col: torch.Tensor  # [S] int64, block-table column
    off: torch.Tensor  # [S] int64, offset in the block
    cu_k: torch.Tensor  # [num_reqs + 1] int32
    total: int  # S
    # The cache slots of those tokens, for one metadata object (a step's block tables
    # do not change while its layers run; the runner builds new metadata every step).
    slots: tuple[AttentionMetadata, torch.Tensor] | None = None


@dataclass
class _Plan:
    """Per-step structure of the batch (host metadata only), shared by every layer."""

    qsl: torch.Tensor
    seq_lens: torch.Tensor
    decodes: list[int]  # rows of one-token requests
    chunks: list[int]  # rows of longer requests
    decode_tokens: torch.Tensor | None  # device, token index of each decode (None: 0..B-1)
    decode_blocks: int
    # [B, 1, 1, nblk * bs] bool, True = attend; built on first use (torch path only)
    decode_mask: torch.Tensor | None
    # device, a mixed step's decodes: (request rows, query starts 0..B); see _decode_rows
    decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # the Triton expanded path's context index (_context_index)
    context_index: _ContextIndex | None = None


def _entries(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache[0]`` (``[num_blocks, block_size, 1, L + R]``) for gathers: an fp8 cache
    as its bytes (dequantised by ``_dequant`` after the gather)."""
    return kv_cache[0].view(torch.uint8) if is_fp8(kv_cache) else kv_cache[0]


def _dequant(entries: torch.Tensor, kv_cache: torch.Tensor, k_scale: float,
             dtype: torch.dtype) -> torch.Tensor:
    """Gathered ``_entries`` as values: an fp8 cache's bytes -> ``e4m3 * k_scale`` in
    ``dtype`` (the product in fp32); a cache in the model dtype is returned as it is."""
    if not is_fp8(kv_cache):
        return entries
    return (entries.view(kv_cache.dtype).float() * k_scale).to(dtype)


# The Triton kernels this backend calls, by name: (module, function).
_KERNELS = {"decode": ("pagedllm.kernels.mla_decode", "mla_decode"),
            "prefill": ("pagedllm.kernels.mla_prefill", "mla_prefill"),
            "prologue": ("pagedllm.kernels.mla_rope_write", "mla_rope_norm_write")}


@functools.cache
def _import_kernel(name: str) -> Any | None:
    """``_KERNELS[name]``'s function, or None where its module does not import; looked
    up once (every layer of every eager step asks)."""
    module, fn = _KERNELS[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except ImportError:
        return None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class MLATorchBackend:
    """Writes ``[c_kv | k_pe]`` at ``slot_mapping`` and attends over the paged latent
    cache in the absorbed or expanded form (module docstring).

    Holds no per-request state; it caches the plan of the last metadata it saw (checked by
    identity and by the host tensors' contents, as ``torch_ref.TorchReferenceBackend``)."""

    name = "mla-torch"
    kv_cache_dtypes = ("auto", "fp8")

    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel
        # Call the Triton kernels (decode and prefill) on CPU tensors too (tests,
        # TRITON_INTERPRET=1).
        self.kernel_on_cpu = False
        self._meta_seq: torch.Tensor | None = None
        self._plan_cache: _Plan | None = None

    def _triton(self, x: torch.Tensor, name: str) -> Any | None:
        """The ``_KERNELS[name]`` function where the Triton kernels run for ``x`` (CUDA,
        or the CPU with ``kernel_on_cpu``) and its module imports, else None."""
        if not (self.use_kernel and (x.is_cuda or self.kernel_on_cpu)):
            return None
        return _import_kernel(name)

    # -- cache write --------------------------------------------------------------

    @staticmethod
    def write(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              meta: AttentionMetadata, k_scale: float = 1.0) -> None:
        """``c_kv [T, L]`` and ``k_pe [T, R]`` (rows ``>= num_actual_tokens`` are
        skipped; slots of -1 too on the CPU, into the null block 0 elsewhere) into
        ``kv_cache`` at ``meta.slot_mapping``.  An fp8 cache gets
        ``entry / k_scale`` saturated and rounded to e4m3 (``quantize_kv``, as the GQA
        caches' writes); ``k_scale`` is ignored otherwise."""
        n = meta.num_actual_tokens
        if n == 0:
            return
        _, nb, bs, _, width = kv_cache.shape
        entry = torch.cat((c_kv[:n], k_pe[:n]), dim=-1)
        flat = kv_cache.view(nb * bs, width)
        if is_fp8(kv_cache):  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            entry = quantize_kv(entry, k_scale).view(torch.uint8)
            flat = flat.view(torch.uint8)
        else:
            entry = entry.to(kv_cache.dtype)
        slots = meta.slot_mapping[:n]
        valid = slots >= 0
        if kv_cache.device.type != "cpu":
            # No boolean indexing (a device->host sync; CUDA graphs cannot capture it):
            # padded rows (slot -1) write into the null block, block 0, which the block
            # pool never hands to a request.
            slots = torch.where(valid, slots, torch.zeros_like(slots))
        elif not bool(valid.all()):
            slots, entry = slots[valid], entry[valid]
        flat.index_copy_(0, slots, entry)

    def rope_norm_write(self, q: torch.Tensor, ckv: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, rope: RopeInputs, interleaved: bool,
                        kv_cache: torch.Tensor, meta: AttentionMetadata, nope: int,
                        k_scale: float = 1.0) -> torch.Tensor | None:
        """The layer's prologue in one launch where the Triton kernel runs (CUDA, or the
        CPU with ``kernel_on_cpu``; ``kernels/mla_rope_write.py``): ``q [T, H, Dn + R]``
        and ``ckv [T, L + R]`` (``kv_a_proj_with_mqa``'s output) -> the rotated ``q_pe
        [T, H, R]``, with ``[rms_norm(c_kv) * norm_weight | rotated k_pe]`` stored as
        :meth:`write` stores it.  None where the kernel does not run: the caller then
        rotates, normalises and calls :meth:`write` in torch (same values)."""
        kernel = self._triton(q, "prologue")
        if kernel is None:
            return None
        return kernel(q, ckv, norm_weight, eps, rope.positions, rope.cos_sin_cache,
                      kv_cache, meta.slot_mapping, meta.num_actual_tokens, nope,
                      interleaved=interleaved, k_scale=k_scale)

    # -- attention ----------------------------------------------------------------

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_b_weight: torch.Tensor,
                dims: MLADims, mode: MLAMode = "auto", k_scale: float = 1.0) -> torch.Tensor:
        """Attention of the step's new tokens over their requests' cached context (the
        tokens just written included).  ``q_nope [T, H, Dn]``, ``q_pe [T, H, R]``
        (rotated), ``kv_b_weight [H * (Dn + Dv), L]`` -> ``[T, H, Dv]`` in q's dtype;
        rows ``>= num_actual_tokens`` may hold anything.  ``k_scale``: an fp8 cache's
        scale (the one ``write`` divided by; ignored for other caches)."""
        t = q_nope.shape[0]
        if meta.num_reqs == 0 or meta.num_actual_tokens == 0:
            return q_nope.new_zeros(t, dims.num_heads, dims.v_head_dim)
        w = kv_b_weight.view(dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim,
                             dims.kv_lora_rank)
        w_uk, w_uv = w[:, :dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim:]
        if not meta.host_lens:
            return self._graph_step(q_nope, q_pe, kv_cache, meta, scale, w_uk, w_uv,
                                    k_scale)
        plan = self._plan(meta, kv_cache.shape[2], q_nope.device)
        qsl = plan.qsl.tolist()
        absorbed_rows = plan.decodes if mode == "auto" else \
            (list(range(meta.num_reqs)) if mode == "absorbed" else [])
        expanded_rows = plan.chunks if mode == "auto" else \
            (list(range(meta.num_reqs)) if mode == "expanded" else [])
        if mode == "auto" and plan.decodes:
            o_lat, tokens = self._decodes(q_nope, q_pe, w_uk, kv_cache, meta, plan, scale,
                                          k_scale)
            o = self._up_v(o_lat, w_uv)
            if tokens is None and o.shape[0] == t:  # a decode-only step: every row
                return o
            out = q_nope.new_zeros(t, dims.num_heads, dims.v_head_dim)
            if tokens is None:
                out[:o.shape[0]] = o
            else:
                out[tokens] = o
            absorbed_rows = []
        else:
            out = q_nope.new_zeros(t, dims.num_heads, dims.v_head_dim)
        for r in absorbed_rows:
            s, e = qsl[r], qsl[r + 1]
            latent = self._gather(kv_cache, meta, r, int(plan.seq_lens[r]), k_scale,
                                  q_nope.dtype)
            q_lat = self._absorb_q(q_nope[s:e], w_uk)
            o_lat = self._attend_latent(q_lat, q_pe[s:e], latent, dims, scale)
            out[s:e] = self._up_v(o_lat, w_uv)
        if expanded_rows:
            self._expanded(q_nope, q_pe, kv_cache, meta, plan, scale, kv_b_weight, dims,
                           expanded_rows, out, k_scale)
        return out

    def _graph_step(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, k_scale: float) -> torch.Tensor:
        """A step replayed from a CUDA graph (``meta.host_lens`` False: no host plan).
        Every row, prompt chunks included, attends in the absorbed form through the
        decode kernel, whose launch depends on host ints alone (``max_query_len`` is the
        graph's token count); it reads the lengths from the device metadata.  In a chunk
        graph rows past the last request's tokens (padding) come out zero; a decode
        graph's rows are all requests' (padded ones read the null block)."""
        kernel = self._triton(q_nope, "decode")
        if kernel is None:
            raise RuntimeError("MLA: a step without host lengths (a CUDA graph's) needs "
                               "the Triton decode kernel (kernels/mla_decode.py)")
        n = meta.num_reqs
        q_lat = self._absorb_q(q_nope, w_uk)
        # A chunk graph's padding rows, which the kernel skips, are zeroed first.
        o_lat = q_lat.new_zeros(q_lat.shape) if meta.max_query_len > 1 else None
        o_lat = kernel(_last_dim_contiguous(q_lat),
                       _last_dim_contiguous(q_pe), kv_cache, meta.block_tables[:n],
                       meta.seq_lens[:n], meta.query_start_loc[:n + 1], scale,
                       meta.max_query_len, out=o_lat, k_scale=k_scale)
        return self._up_v(o_lat, w_uv)

    @staticmethod
    def _absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, Dn]`` x ``W_UK [H, Dn, L]`` -> ``q_latent [T, H, L]``."""
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    @staticmethod
    def _up_v(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """``o_latent [T, H, L]`` x ``W_UV [H, Dv, L]^T`` -> ``[T, H, Dv]``."""
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int, seq_len: int,
                k_scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Request ``row``'s cached entries in position order: ``[seq_len, L + R]``, in
        the cache's dtype, or an fp8 cache's dequantised into ``dtype``."""
        bs = kv_cache.shape[2]
        blocks = meta.block_tables[row, :-(-seq_len // bs)].long()
        rows = _entries(kv_cache).index_select(0, blocks).flatten(0, 1)[:seq_len, 0]
        return _dequant(rows, kv_cache, k_scale, dtype or torch.float32)

    @staticmethod
    def _attend_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       dims: MLADims, scale: float) -> torch.Tensor:
        """One request's absorbed attention, causal with a context offset:
        ``q_lat [Q, H, L]``, ``q_pe [Q, H, R]``, ``latent [S, L + R]`` -> ``[Q, H, L]``."""
        nq, s = q_lat.shape[0], latent.shape[0]
        q = torch.cat((q_lat, q_pe), dim=-1).to(latent.dtype).transpose(0, 1)  # [H, Q, L+R]
        k = latent.unsqueeze(0)  # [1, S, L+R], shared by every head
        v = latent[:, :dims.kv_lora_rank].unsqueeze(0)
        mask = None
        if nq > 1:
            qpos = torch.arange(s - nq, s, device=q.device).unsqueeze(1)
            mask = torch.arange(s, device=q.device).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1).to(q_lat.dtype)

    def _decodes(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, plan: _Plan,
                 scale: float, k_scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All one-token requests at once in the absorbed form -> ``(o_latent [B, H, L],
        their token rows or None for rows 0..B-1)``."""
        b = len(plan.decodes)
        tokens = plan.decode_tokens
        qn = q_nope[:b] if tokens is None else q_nope.index_select(0, tokens)
        qp = q_pe[:b] if tokens is None else q_pe.index_select(0, tokens)
        q_lat = self._absorb_q(qn, w_uk)
        kernel = self._triton(q_nope, "decode")
        if kernel is not None:
            if tokens is None:  # decode-only step (graph-safe: no copies, host ints only)
                tables, seqs = meta.block_tables[:b], meta.seq_lens[:b]
                qsl = meta.query_start_loc[:b + 1]
            else:  # a mixed step's decodes (eager): their rows of the device metadata
                rows, qsl = self._decode_rows(plan, q_nope.device)
                tables = meta.block_tables.index_select(0, rows)
                seqs = meta.seq_lens.index_select(0, rows)
            # The kernel takes any token / head strides: no copies of the transposed
            # q_lat or the sliced q_pe.
            o = kernel(_last_dim_contiguous(q_lat),
                       _last_dim_contiguous(qp), kv_cache, tables, seqs, qsl, scale, 1,
                       k_scale=k_scale)
            return o, tokens
        lat = kv_cache.shape[-1] - q_pe.shape[-1]
        if plan.decode_mask is None:  # built here, not in _plan: the kernel path needs none
            dev_seq = plan.seq_lens[plan.decodes].to(q_nope.device)
            plan.decode_mask = (torch.arange(plan.decode_blocks * kv_cache.shape[2],
                                             device=q_nope.device)
                                < dev_seq.unsqueeze(1))[:, None, None, :]
        if tokens is None:
            tables = meta.block_tables[:b, :plan.decode_blocks]
        else:
            rows, _ = self._decode_rows(plan, q_nope.device)
            tables = meta.block_tables.index_select(0, rows)[:, :plan.decode_blocks]
        length = plan.decode_blocks * kv_cache.shape[2]
        entries = _entries(kv_cache).index_select(0, tables.reshape(-1).long()).view(
            b, length, kv_cache.shape[-1])
        entries = _dequant(entries, kv_cache, k_scale, q_nope.dtype)
        q = torch.cat((q_lat, qp), dim=-1).to(entries.dtype).unsqueeze(1)  # [B, 1, H, L+R]
        o = F.scaled_dot_product_attention(q, entries.unsqueeze(1),
                                           entries[..., :lat].unsqueeze(1),
                                           attn_mask=plan.decode_mask, scale=scale)
        return o[:, 0].to(q_nope.dtype), tokens

    @staticmethod
    def _decode_rows(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixed step's decodes on the device, made once per step (every layer reads
        them): their request rows, and ``0..B`` as their query starts (one token each)."""
        if plan.decode_rows is None:
            plan.decode_rows = (torch.tensor(plan.decodes, device=device),
                                torch.arange(len(plan.decodes) + 1, dtype=torch.int32,
                                             device=device))
        return plan.decode_rows

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, plan: _Plan, scale: float,
                  kv_b_weight: torch.Tensor, dims: MLADims, rows: list[int],
                  out: torch.Tensor, k_scale: float = 1.0) -> None:
        """Requests ``rows`` in the expanded form; one ``kv_b_proj`` GEMM over all their
        contexts, then one kernel launch on CUDA (``_expanded_kernel``), else one SDPA per
        request (causal with a context offset)."""
        kernel = self._triton(q_nope, "prefill")
        if kernel is not None:
            self._expanded_kernel(kernel, q_nope, q_pe, kv_cache, meta, plan, scale,
                                  kv_b_weight, dims, rows, out, k_scale)
            return
        qsl = plan.qsl.tolist()
        lens = [int(plan.seq_lens[r]) for r in rows]
        latents = [self._gather(kv_cache, meta, r, n, k_scale, q_nope.dtype)
                   for r, n in zip(rows, lens)]
        latent = torch.cat(latents) if len(latents) > 1 else latents[0]
        c_kv = latent[:, :dims.kv_lora_rank].to(q_nope.dtype)
        k_pe = latent[:, dims.kv_lora_rank:].to(q_nope.dtype)
        kv = F.linear(c_kv, kv_b_weight).view(-1, dims.num_heads,
                                              dims.qk_nope_head_dim + dims.v_head_dim)
        k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, dims.num_heads, -1)), dim=-1)
        q_all = torch.cat((q_nope, q_pe), dim=-1)
        start = 0
        for r, n in zip(rows, lens):
            s, e = qsl[r], qsl[r + 1]
            nq = e - s
            q = q_all[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, Q, Dn + R]
            kr = k[start:start + n].transpose(0, 1).unsqueeze(0)
            vr = v[start:start + n].transpose(0, 1).unsqueeze(0)
            start += n
            if nq == n:
                o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)
            else:
                qpos = torch.arange(n - nq, n, device=q.device).unsqueeze(1)
                mask = torch.arange(n, device=q.device).unsqueeze(0) <= qpos
                o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale)
            out[s:e] = o[0].transpose(0, 1)

    def _expanded_kernel(self, kernel: object, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata, plan: _Plan,
                         scale: float, kv_b_weight: torch.Tensor, dims: MLADims,
                         rows: list[int], out: torch.Tensor, k_scale: float) -> None:
        """``_expanded`` through ``kernels/mla_prefill.py``: the rows' contexts in one
        gather (no loop over requests), one ``kv_b_proj`` GEMM, one launch over the
        step's ``query_start_loc``; rows not in ``rows`` get an empty context, so the
        kernel leaves their outputs (the absorbed form's) as they are.  No device->host
        sync: sizes are the plan's host ints."""
        bs = kv_cache.shape[2]
        idx = self._context_index(plan, rows, bs, q_nope.device)
        if idx.slots is None or idx.slots[0] is not meta:  # once a step, not per layer
            idx.slots = (meta, meta.block_tables[idx.req, idx.col].long() * bs + idx.off)
        slots = idx.slots[1]
        latent = _entries(kv_cache).flatten(0, 2).index_select(0, slots)  # [S, L + R]
        latent = _dequant(latent, kv_cache, k_scale, q_nope.dtype)
        c_kv = latent[:, :dims.kv_lora_rank].to(q_nope.dtype)
        k_pe = latent[:, dims.kv_lora_rank:].to(q_nope.dtype)  # a strided view: no copy
        kv = F.linear(c_kv, kv_b_weight).view(idx.total, dims.num_heads,
                                              dims.qk_nope_head_dim + dims.v_head_dim)
        k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
        kernel(_last_dim_contiguous(q_nope), _last_dim_contiguous(q_pe),  # type: ignore[operator]
               k_nope, _last_dim_contiguous(k_pe), v,
               meta.query_start_loc[:meta.num_reqs + 1], idx.cu_k, scale, out=out)

    @staticmethod
    def _context_index(plan: _Plan, rows: list[int], block_size: int,
                       device: torch.device) -> _ContextIndex:
        """The expanded rows' context index (``_ContextIndex``), built on the host from
        the plan's lengths with vector ops and copied once a step (every layer reads
        it).  Block ids are cached only per metadata object (``_ContextIndex.slots``), so
        a plan reused for a later step with equal lengths reads that step's tables."""
        key = tuple(rows)
        cached = plan.context_index
        if cached is not None and cached.rows == key:
            return cached
        num_reqs = plan.seq_lens.shape[0]
        rows_t = torch.tensor(rows, dtype=torch.long)
        lens = plan.seq_lens.long().index_select(0, rows_t)
        per_req = torch.zeros(num_reqs, dtype=torch.long).index_copy_(0, rows_t, lens)
        cu_k = torch.zeros(num_reqs + 1, dtype=torch.long)
        cu_k[1:] = per_req.cumsum(0)
        total = int(cu_k[-1])
        req = rows_t.repeat_interleave(lens)
        pos = torch.arange(total) - cu_k.index_select(0, rows_t).repeat_interleave(lens)
        host = torch.stack((req, pos // block_size, pos % block_size))
        dev = host.to(device)
        plan.context_index = _ContextIndex(key, dev[0], dev[1], dev[2],
                                           cu_k.to(device=device, dtype=torch.int32), total)
        return plan.context_index

    def _plan(self, meta: AttentionMetadata, block_size: int,
              device: torch.device) -> _Plan:
        qsl = meta.query_start_loc_cpu[:meta.num_reqs + 1]
        seq_lens = meta.seq_lens_cpu[:meta.num_reqs]
        cached = self._plan_cache
        if (cached is not None and self._meta_seq is meta.seq_lens
                and torch.equal(cached.qsl, qsl) and torch.equal(cached.seq_lens, seq_lens)):
            return cached
        qlens = (qsl[1:] - qsl[:-1]).tolist()
        decodes = [r for r, n in enumerate(qlens) if n == 1]
        chunks = [r for r, n in enumerate(qlens) if n > 1]
        tokens = None
        nblk = 0
        if decodes:
            nblk = -(-int(seq_lens[decodes].max()) // block_size)
            if decodes != list(range(len(decodes))) or len(decodes) != meta.num_reqs:
                tokens = qsl[decodes].to(device=device, dtype=torch.long)
        # A decode-only step (what a CUDA graph captures) copies nothing to the device
        # here: its rows are 0..B-1 and the kernel reads the device metadata.
        plan = _Plan(qsl.clone(), seq_lens.clone(), decodes, chunks, tokens, nblk, None)
        self._meta_seq, self._plan_cache = meta.seq_lens, plan
        return plan
