"""One C call per layer for a decode step on the CPU: rotary embedding, KV write and
paged attention (``cpu/csrc/decode_attention.c``).

On a small model at batch 1 the torch reference spends ~0.3 ms per layer in some 40
tiny ops (rotation, two ``index_copy_``, block gathers, a masked SDPA) whose work is a
few microseconds; this kernel does the same work in one call.  ``run`` computes what
``TorchReferenceBackend.forward_rope`` computes for a step in which every request has
exactly one new token, up to float rounding in the attention (the rotation and the
cached keys and values are bit-identical).  Every other float32 step reaches ``run``
too, recast by ``cpu_backend.row_plan`` as one "request" per query row (its request's
block table, its own key count): the kernel writes every row's keys and values before
any row attends, so a prompt row is a decode row that sees fewer keys.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.attention.kinds import AttentionKind
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs
from pagedllm.cpu import build

_SRC = build.CSRC / "decode_attention.c"
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_long
_F = ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_attention.restype = _I
    lib.decode_attention.argtypes = [_I, _I, _I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _L,
                                     _P, _P, _P, _L, _I, _P, _P, _L, _P, _F, _I, _F, _P, _I]


def _lib() -> ctypes.CDLL | None:
    return build.load(_SRC, "CPU decode attention", _declare)


def takes_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor) -> bool:
    """Whether ``run`` can take rows of these tensors: float32 activations and cache (not
    fp8) on the CPU, unit inner strides, and the library built."""
    return (query.dtype is torch.float32 and kv_cache.dtype is torch.float32
            and key.dtype is torch.float32 and value.dtype is torch.float32
            and not query.is_cuda and query.stride(-1) == 1 and key.stride(-1) == 1
            and value.stride(-1) == 1 and kv_cache.is_contiguous() and _lib() is not None)


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``run`` takes this call: a step in which every request decodes one token,
    and ``takes_rows``.  Shapes and types only, never data; the metadata's documented
    dtypes (int32 tables and lengths, float32 rotary tables) are taken as given."""
    return (meta.max_query_len == 1 and meta.num_actual_tokens == meta.num_reqs
            and takes_rows(query, key, value, kv_cache))


def step_indices(rope: RopeInputs, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's positions and slot mapping as the int64 arrays the C kernels read."""
    pos, slots = rope.positions, meta.slot_mapping
    return (pos if pos.dtype is torch.int64 else pos.long(),
            slots if slots.dtype is torch.int64 else slots.long())


def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rope: RopeInputs,
        kind: AttentionKind) -> torch.Tensor:
    """Rotate ``query`` (in place) and ``key``, store ``key``/``value`` at
    ``meta.slot_mapping``, and return each query's attention over its request's cache
    as ``[T, Hq, D]``.  Needs ``applies(...)``; ``kind`` may carry a sliding window and a
    logit soft-cap."""
    lib = _lib()
    assert lib is not None
    t, hq, d = query.shape
    hk = key.shape[1]
    _, nb, bs, _, _ = kv_cache.shape
    out = torch.empty(t, hq, d, dtype=query.dtype)
    pos, slots = step_indices(rope, meta)
    tables = meta.block_tables
    rc = lib.decode_attention(
        t, hq, hk, d, rope.cos_sin_cache.shape[-1], query.data_ptr(), query.stride(0),
        query.stride(1), key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(),
        value.stride(0), value.stride(1),
        rope.cos_sin_cache.data_ptr(), pos.data_ptr(), kv_cache.data_ptr(), nb, bs,
        slots.data_ptr(), tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
        scale, kind.sliding_window or 0, kind.logits_soft_cap or 0.0, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode attention: cannot allocate its score buffer")
    return out
