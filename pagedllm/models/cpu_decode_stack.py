"""A Llama-shaped decoder stack for one decode step on the CPU, in one C call
(``cpu/csrc/decode_stack.c``).

At batch 1 a small quantised model spends more of a CPU decode step in Python than in
its kernels: each layer is some 40 module calls and 7 ctypes calls (two RMSNorms, four
int4 GEMMs, the attention, the activation), ~0.35 ms of interpreter time against
~0.4 ms of arithmetic on the default model.  This stack runs those same C kernels, in the
same order on the same buffers, for every layer in one call, so its output is
bit-identical to the per-module path and only the Python goes.

The model decides what its layers are (``StackLayer``: the two norm weights, the four
projections as packed int4 segments, the layer's KV cache and attention kind) and calls
``DecodeStack.build`` once; ``run`` takes a step when ``applies`` says so: every request
decodes one token, float32 activations on the CPU.  Everything else (prompts, chunks,
speculative verification, other weight formats) stays on the per-module path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.cpu_decode import step_indices
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.rope import RopeInputs
from pagedllm.cpu import build
from pagedllm.layers.quantization.int4_vnni import MAX_PARTS

_SRC = build.CSRC / "decode_stack.c"
MAX_SEGS = 4  # cpu/csrc/decode_stack.c
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_long
_F = ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("nseg", _I), ("k", _I), ("act8", _I), ("nparts", _I * MAX_SEGS),
                ("n", _I * MAX_SEGS),
                ("group", _I * MAX_SEGS), ("packed", (_P * MAX_PARTS) * MAX_SEGS),
                ("sz", (_P * MAX_PARTS) * MAX_SEGS)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("cache", _P), ("nb", _L),
                ("window", _I), ("softcap", _F), ("scale", _F)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_stack.restype = _I
    lib.decode_stack.argtypes = [_I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _I, _P, _P,
                                 _I, _P, _P, _L, _P, _I]


def _lib() -> ctypes.CDLL | None:
    return build.load(_SRC, "CPU decode stack", _declare)


@dataclass
class StackLayer:
    """One decoder layer as the stack computes it (the C file's per-layer formula).

    ``qkv``/``o``/``gate_up``/``down``: ``LinearBase.int4_segments`` of the projections
    (q, k, v and gate, up concatenated along the output as the fused layers store them);
    ``cache``: the layer's ``[2, blocks, block_size, kv_heads, head_dim]`` float32 KV
    cache; ``window``/``softcap``: 0 for none."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: list[list[Any]]
    o: list[list[Any]]
    gate_up: list[list[Any]]
    down: list[list[Any]]
    cache: torch.Tensor
    scale: float
    window: int = 0
    softcap: float = 0.0


def _linear(segs: list[list[Any]], n: int, k: int) -> _Linear | None:
    """The C description of ``segs`` as an ``[n, k]`` weight, or None when it does not
    fit (parts not all in one of the vnni4 / vnni4x8 layouts, too many segments or parts,
    shapes off)."""
    if not segs or len(segs) > MAX_SEGS or sum(s[0].n for s in segs) != n:
        return None
    layout = segs[0][0].layout
    if layout not in ("vnni4", "vnni4x8"):
        return None
    lin = _Linear(nseg=len(segs), k=k, act8=layout == "vnni4x8")
    for i, parts in enumerate(segs):
        if not 0 < len(parts) <= MAX_PARTS or any(
                p.layout != layout or p.k != k or p.n != parts[0].n
                or p.group != parts[0].group for p in parts):
            return None
        lin.nparts[i], lin.n[i], lin.group[i] = len(parts), parts[0].n, parts[0].group
        for j, p in enumerate(parts):
            lin.packed[i][j] = p.packed.data_ptr()
            lin.sz[i][j] = p.scale_zero.data_ptr()
    return lin


class DecodeStack:
    """The C stack over a model's decoder layers; ``build`` checks, ``run`` computes."""

    def __init__(self, layers: list[StackLayer], c_layers: Any, heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float) -> None:
        self.layers = layers  # keeps every tensor the C structs point into alive
        self.c_layers = c_layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.inter, self.eps = inter, eps

    @classmethod
    def build(cls, layers: list[StackLayer], hidden: int, heads: int, kv_heads: int,
              head_dim: int, inter: int, eps: float) -> DecodeStack | None:
        """The stack over ``layers`` (all of one shape), or None when the library is not
        built or a layer does not fit: a
        projection not wholly packed int4 in the vnni4 layout, a norm weight or cache not
        float32 and contiguous."""
        if not layers or _lib() is None:
            return None
        qkv_n = (heads + 2 * kv_heads) * head_dim
        arr = (_Layer * len(layers))()
        for c, lay in zip(arr, layers):
            lins = [_linear(lay.qkv, qkv_n, hidden), _linear(lay.o, hidden, heads * head_dim),
                    _linear(lay.gate_up, 2 * inter, hidden), _linear(lay.down, hidden, inter)]
            tensors = (lay.ln1, lay.ln2, lay.cache)
            if any(x is None for x in lins) or any(
                    x.dtype is not torch.float32 or x.is_cuda or not x.is_contiguous()
                    for x in tensors) or lay.ln1.numel() != hidden \
                    or lay.ln2.numel() != hidden or lay.cache.dim() != 5 \
                    or tuple(lay.cache.shape[3:]) != (kv_heads, head_dim):
                return None
            c.qkv, c.o, c.gate_up, c.down = lins  # type: ignore[misc]
            c.ln1, c.ln2, c.cache = lay.ln1.data_ptr(), lay.ln2.data_ptr(), \
                lay.cache.data_ptr()
            c.nb, c.window, c.softcap, c.scale = lay.cache.shape[1], lay.window, \
                lay.softcap, lay.scale
        return cls(layers, arr, heads, kv_heads, head_dim, inter, eps)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step in which every request decodes one token (one row each), float32 rows
        on the CPU.  Shapes and types only, never data."""
        return (meta.max_query_len == 1 and meta.num_actual_tokens == meta.num_reqs
                and hidden.dim() == 2 and hidden.shape[0] == meta.num_reqs
                and hidden.dtype is torch.float32 and not hidden.is_cuda)

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers' ``(hidden, residual)`` for this step, as the layers would
        return them one by one (``residual`` None: the first layer's convention).  Writes
        the step's keys and values into the caches.  Needs ``applies``."""
        lib = _lib()
        assert lib is not None
        t, h = hidden.shape
        # Contiguous copies: the inputs stay as they were.
        out = hidden.clone(memory_format=torch.contiguous_format)
        res = torch.empty_like(out) if residual is None \
            else residual.clone(memory_format=torch.contiguous_format)
        pos, slots = step_indices(rope, meta)
        tables = meta.block_tables
        cos_sin = rope.cos_sin_cache
        rc = lib.decode_stack(
            len(self.layers), ctypes.addressof(self.c_layers), t, h, self.heads,
            self.kv_heads, self.head_dim, cos_sin.shape[-1], self.inter, self.eps,
            out.data_ptr(), res.data_ptr(), residual is not None, cos_sin.data_ptr(),
            pos.data_ptr(), self.layers[0].cache.shape[2], slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
            torch.get_num_threads())
        if rc == -2:
            raise MemoryError("CPU decode stack: cannot allocate its buffers")
        if rc != 0:
            raise ValueError("CPU decode stack: arguments outside its kernels' contract")
        return out, res
