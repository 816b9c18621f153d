"""Build a model on its device in its dtype and fill its weights.

``load_format``:

* ``safetensors`` -- every ``*.safetensors`` in the HF directory (sharded or not),
  streamed tensor by tensor; ``tie_word_embeddings`` is handled by the model.
* ``gguf`` -- llama.cpp names mapped to HF names, tensors dequantised to float32 with
  ``gguf.quants.dequantize``; Llama's q/k rows are un-permuted (see ``_unpermute``).
  Under the ``gguf`` quantisation method (the default for a quantised GGUF) supported
  quantised tensors are handed over as raw blocks instead (``layers/quantization/
  gguf.py``).
* ``dummy`` -- random weights generated on the target device (a GPU never waits on CPU
  random numbers, so an 8B shape builds in seconds).  ``dummy_init`` "uniform" (the
  default) is vLLM's ``initialize_dummy_weights``: every parameter, norms included,
  ``uniform(-1e-3, 1e-3)``, so benchmarks run both engines on the same weights.  That
  matters on a GPU at its power cap: W1 runs at the H200's 700 W limit, where the
  weights' values change the clock (normal(0, 0.02) ran W1 ~0.8% slower,
  docs/findings.md run 14).  "normal" is ``normal(0, 0.02)`` with norm weights 1:
  logits far enough apart that bf16 greedy tokens are comparable across code paths
  (the GPU checks that compare graphs, eager and async runs use it).

Under tensor parallelism (or with a ``ReadCounter``) both formats hand the layers
``LazyWeight``s, so each rank reads only its shard of each tensor
(``models/lazy_weight.py``); a single rank reads plain tensors as before.

Missing or corrupt files raise ``ValueError`` with a one-line reason naming the file.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import current_parallel_state
from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.norm import link_norms
from pagedllm.layers.quantization import get_quantization_config_class
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.lazy_weight import LazyWeight, ReadCounter
from pagedllm.models.registry import get_model_class

logger = logging.getLogger("pagedllm")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_shape(model_config: Any, num_blocks: int,
                   block_size: int) -> tuple[int, int, int, int, int]:
    """One layer's KV cache: ``(entries, num_blocks, block_size, num_kv_heads,
    head_dim)``, entries = 2 (keys, values) for GQA, 1 for MLA's latent entry
    (``ModelConfig.kv_entries_per_token``)."""
    return (getattr(model_config, "kv_entries_per_token", 2), num_blocks, block_size,
            model_config.num_kv_heads, model_config.head_dim)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_quant_config(model_config: Any, device: torch.device) -> QuantizationConfig | None:
    """The model's ``QuantizationConfig`` (None when unquantised), checked against the
    device and dtype it will run on."""
    name = getattr(model_config, "quantization", None)
    if name is None:
        return None
    cls = get_quantization_config_class(name)
    qc = cls.from_config(model_config.hf_config, model_config)
    qc.check_device(device.type, model_config.dtype)
    return qc


def load_model(model_config: Any, device: torch.device, backend: AttentionBackend,
               read_counter: ReadCounter | None = None) -> nn.Module:
    """The model for ``model_config`` (a ``pagedllm.config.ModelConfig``) on ``device``,
    in ``model_config.dtype``, in eval mode, weights loaded per ``load_format`` and
    stored as its quantisation method decides (``layers/quantization/``).
    ``read_counter``: records the bytes read per tensor (shard-only reading is on
    with it, and always under tensor parallelism)."""
    hf_config = model_config.hf_config
    cls = get_model_class(hf_config)
    dtype = _DTYPES[model_config.dtype]
    device = torch.device(device)
    quant_config = make_quant_config(model_config, device)
    with _default_dtype(dtype), device:
        model = cls(hf_config, backend, quant_config) if quant_config is not None \
            else cls(hf_config, backend)
    # For the start-up log (worker.py): the method and its layout in one line.
    model.quant_description = None if quant_config is None else "; ".join(
        d for d in (quant_config.describe(), quant_config.describe_kernels(device)) if d)
    fmt = model_config.load_format
    resolved = model_config.resolved
    # A pipeline stage reads (and dequantises) only its own tensors (models/llama.py).
    other_stage = getattr(model, "_on_other_stage", None)
    keep = None if other_stage is None else (lambda name: not other_stage(name))
    counter = read_counter
    if counter is None and current_parallel_state().tp_size > 1:
        counter = ReadCounter()  # for the log line below
    if fmt == "dummy":
        _init_dummy(model, device, int(getattr(model_config, "seed", 0)),
                    getattr(model_config, "dummy_init", "uniform"))
    elif fmt == "safetensors":
        model.load_weights(  # type: ignore[operator]
            take_kv_scales(model, iter_safetensors(resolved.directory, keep, counter)))
    elif fmt == "gguf":
        path = resolved.gguf_path
        if path is None:
            raise ValueError(f"load_format: 'gguf' but {resolved.directory} holds no .gguf")
        model.load_weights(iter_gguf(  # type: ignore[operator]
            path, hf_config, keep,
            keep_quantized=bool(getattr(quant_config, "gguf_raw", False)), counter=counter))
    else:
        raise ValueError(f"load_format must be safetensors, gguf or dummy, got {fmt!r}")
    finish_loading(model)
    if model.quant_description and device.type == "cuda":
        from pagedllm.layers.quantization.int_cuda import layout_summary

        layouts = layout_summary(model.modules())  # what the int storage decided
        if layouts:
            model.quant_description += f"; {layouts}"
    if counter is not None and counter.whole:
        logger.info("tensor-parallel rank %d: %s", current_parallel_state().tp.rank_in_group,
                    counter.summary())
    return model.eval()


def finish_loading(model: nn.Module) -> None:
    """After the weights are in: each quantisation method's post-load repack, then the
    norms that do part of the next projection's work (``link_norms``)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (LinearBase, FusedMoE)):
                module.quant_method.process_weights_after_loading(module)  # type: ignore
            elif isinstance(module, VocabParallelEmbedding) and module.quant_method:
                module.quant_method.process_weights_after_loading(module)
    link_norms(model)


_KV_SCALE = re.compile(r"^(.*\.self_attn)\.([kv])_scale$")


def take_kv_scales(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through, except a checkpoint's per-layer KV-cache scales
    (``model.layers.N.self_attn.k_scale`` / ``v_scale``, compressed-tensors'
    ``kv_cache_scheme``): those become the layer's ``Attention.k_scale`` / ``v_scale``
    host floats, used by an fp8 KV cache (``attention/kv_cache_dtype.py``).  An MLA layer
    (``layers/mla.py``, itself the ``self_attn`` module) takes ``k_scale`` for its
    latent cache; its ``v_scale`` is dropped (the latent is keys and values at once)."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        m = _KV_SCALE.match(name)
        attn = None
        if m:
            attn = modules.get(f"{m.group(1)}.attn")
            attn = modules.get(m.group(1)) if attn is None else attn
        if attn is None or not hasattr(attn, "k_scale"):
            yield name, tensor
            continue
        value = float(tensor.float().reshape(-1).max())
        if not value > 0.0:
            raise ValueError(f"checkpoint tensor {name!r}: KV scale must be positive, "
                             f"got {value}")
        if hasattr(attn, f"{m.group(2)}_scale"):
            setattr(attn, f"{m.group(2)}_scale", value)


def weight_bytes(model: nn.Module, as_dtype_bytes: int | None = None) -> int:
    """Bytes of the model's weights as stored (tied tensors counted once); with
    ``as_dtype_bytes``, what they would take unquantised at that element size (packed
    elements unpacked, quantisation scales not counted)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if as_dtype_bytes is None:
            total += t.numel() * t.element_size()
        elif "scale" not in name.rsplit(".", 1)[-1] and "zero" not in name.rsplit(".", 1)[-1]:
            total += t.numel() * int(getattr(t, "packed_factor", 1)) * as_dtype_bytes
    return total


def _init_dummy(model: nn.Module, device: torch.device, seed: int, init: str) -> None:
    """Fill every parameter per ``init`` ("uniform" or "normal", see the module doc)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        owned: set[int] = set()  # parameters a quantisation method filled itself
        for module in model.modules():
            # Quantised linears and experts fill their own (e4m3, packed) storage.
            dummy = getattr(getattr(module, "quant_method", None), "dummy_init", None)
            if isinstance(module, (LinearBase, FusedMoE)) and dummy is not None \
                    and dummy(module, gen, init):
                owned.update(id(p) for p in module.parameters(recurse=False))
        for name, p in model.named_parameters():
            if id(p) in owned or not p.is_floating_point():
                continue
            if init == "uniform":
                p.uniform_(-1e-3, 1e-3, generator=gen)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


# -- safetensors ----------------------------------------------------------------------

def iter_safetensors(directory: str, keep: Callable[[str], bool] | None = None,
                     counter: ReadCounter | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every ``*.safetensors`` in ``directory``
    (only names ``keep`` accepts are read, when given).  With ``counter``: ``LazyWeight``s
    that read only the slices the layers take (``models/lazy_weight.py``)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if any(not os.path.basename(f).startswith("consolidated") for f in files):
        # Mistral-format duplicates of the HF weights.
        files = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weight files found")
    for path in files:
        try:
            # Not a ``with``: a LazyWeight may be read after the next file is opened.
            f = safe_open(path, framework="pt", device="cpu")
            names = list(f.keys())
            for name in names:
                if keep is None or keep(name):
                    yield name, (f.get_tensor(name) if counter is None
                                 else _lazy_safetensor(f, name, counter))
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{path}: cannot read safetensors file: "
                             f"{str(e).strip().splitlines()[0] if str(e) else e!r}") from e


def _lazy_safetensor(f: Any, name: str, counter: ReadCounter) -> torch.Tensor:
    """``name`` as a ``LazyWeight`` reading ``get_slice(name)[...]`` (0-d: read now)."""
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if not shape:
        return f.get_tensor(name)

    def read_slice(dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return sl[index]

    return LazyWeight(name, shape, sl[0:0].dtype, read_slice,  # type: ignore[return-value]
                      lambda: f.get_tensor(name), counter)


# -- GGUF -----------------------------------------------------------------------------

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name of a llama.cpp tensor name, or None if it has no HF twin."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _BLK.match(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    llama.cpp rotates adjacent pairs (GPT-J style); HF rotates the two halves of each
    head.  The converter reorders each head's rows from ``[half0 | half1]`` to
    interleaved ``[h0[0], h1[0], h0[1], h1[1], ...]``; we view the rows as
    ``[head, pair_idx, 2]`` and swap back to ``[head, 2, pair_idx]``.  (Same as
    transformers' ``LlamaTensorProcessor._reverse_permute_weights``.)
    """
    rows = w.shape[0]
    dim = rows // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(path: str, hf_config: Any, keep: Callable[[str], bool] | None = None,
              keep_quantized: bool = False, counter: ReadCounter | None = None,
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised float32 ``(HF name, tensor)`` pairs from a GGUF file (only HF names
    ``keep`` accepts, when given: a pipeline stage's or a rank's own tensors).

    ``keep_quantized``: tensors of a type in ``gguf_blocks.SUPPORTED`` come instead as
    their raw block bytes, uint8 ``[rows, row_bytes]`` (a copy, not the memmap), with
    the type in a ``ggml_type`` attribute; other types are dequantised as usual.
    ``counter``: the dequantised tensors come as ``LazyWeight``s that read (and
    dequantise) only the rows or block-aligned columns the layers take."""
    from pagedllm.layers.quantization.gguf_blocks import SUPPORTED
    from pagedllm.model_files.gguf_file import GGUFFile

    f = GGUFFile(path)
    arch = f.metadata.get("general.architecture")
    # Only llama.cpp's "llama" converter permutes q/k (qwen2/qwen3 are stored HF-style).
    permute = arch == "llama"
    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for info in f.tensors:
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {info.name!r} "
                             f"(architecture {arch!r})")
        if keep is not None and not keep(hf_name):
            continue
        heads = None
        if permute and ".attn_q." in info.name:
            heads = n_head
        elif permute and ".attn_k." in info.name:
            heads = n_kv
        raw_blocks = keep_quantized and info.ggml_type in SUPPORTED and len(info.shape) == 2
        if raw_blocks:
            t = torch.from_numpy(f.raw(info).copy())
            if heads is not None:  # rows are whole blocks: the permutation applies as is
                t = _unpermute(t, heads)
            t.ggml_type = int(info.ggml_type)  # type: ignore[attr-defined]
            yield hf_name, t
        elif counter is not None and len(info.shape) == 2:
            yield hf_name, _lazy_gguf(f, info, hf_name, heads, counter)
        else:
            yield hf_name, _gguf_dequantized(f, info, heads, slice(None), slice(None))


def _gguf_dequantized(f: Any, info: Any, heads: int | None, rows: slice,
                      cols: slice) -> torch.Tensor:
    """Float32 ``[rows, cols]`` of a GGUF tensor (``cols`` in bytes for a quantised
    type, whole blocks), q/k rows un-permuted over ``heads`` heads."""
    from gguf.quants import dequantize

    raw = f.raw(info)
    if rows != slice(None) or cols != slice(None):
        raw = np.ascontiguousarray(raw[rows, cols] if raw.ndim == 2 else raw[rows])
    try:
        arr = dequantize(raw, info.ggml_type)
    except (NotImplementedError, ValueError) as e:
        raise ValueError(f"{f.path}: cannot dequantise {info.name}: {e}") from e
    if not arr.flags.writeable:  # float32 tensors come back as views of the memmap
        arr = arr.copy()
    t = torch.from_numpy(arr)
    if rows == slice(None) and cols == slice(None):
        t = t.reshape(info.shape)
    return _unpermute(t, heads) if heads is not None else t


def _lazy_gguf(f: Any, info: Any, hf_name: str, heads: int | None,
               counter: ReadCounter) -> torch.Tensor:
    """A 2-D GGUF tensor as a ``LazyWeight``: a row range is read as is (rows are whole
    blocks), a column range when it starts and ends on a quantisation block."""
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    head_rows = info.shape[0] // heads if heads is not None else 0

    def read_slice(dim: int, start: int, length: int) -> torch.Tensor | str:
        if dim == 0:
            if heads is not None and (start % head_rows or length % head_rows):
                return f"rows {start}:{start + length} cut a permuted head"
            return _gguf_dequantized(f, info, length // head_rows if heads else None,
                                     slice(start, start + length), slice(None))
        if start % block or length % block:
            return (f"columns {start}:{start + length} cut a {block}-element "
                    f"quantisation block")
        b0, b1 = start // block * type_size, (start + length) // block * type_size
        if info.ggml_type in (0, 1):  # F32, F16: the memmap is typed, not bytes
            b0, b1 = start, start + length
        return _gguf_dequantized(f, info, heads, slice(None), slice(b0, b1))

    return LazyWeight(hf_name, info.shape, torch.float32, read_slice,  # type: ignore
                      lambda: _gguf_dequantized(f, info, heads, slice(None), slice(None)),
                      counter)
