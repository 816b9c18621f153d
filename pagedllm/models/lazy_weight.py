"""Checkpoint tensors read on demand, so a tensor-parallel rank reads only its shard.

The layers' weight loaders take a rank's part of a checkpoint tensor with
``loaded.narrow(dim, start, size)`` (``layers/linear.py``, ``layers/embedding.py``).
Under tensor parallelism the loader (``models/loader.py``) hands them a ``LazyWeight``
instead of a tensor: its ``narrow`` reads just that slice from the file --
``safe_open(...).get_slice(name)[...]`` for safetensors, the rows or block-aligned
columns of the memory-mapped GGUF tensor -- and any other use (a replicated norm, a
reshape, a copy) reads the tensor whole, once, and behaves as that tensor::

    rank r's weight_loader ── loaded.narrow(0, r*n, n) ──► LazyWeight ── reads n rows
                            └─ param.copy_(loaded) ─────►   (whole)  ── reads all

A slice the format cannot read in place (a GGUF column range that cuts a quantisation
block, a permuted q/k slice that cuts a head) falls back to a whole read, which is
recorded with its reason.  ``ReadCounter`` records what was read: the start-up log
line and the tests read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("pagedllm")

# (dim, start, length) -> the slice, or a reason why it cannot be read in place.
SliceReader = Callable[[int, int, int], "torch.Tensor | str"]


@dataclass
class ReadCounter:
    """Bytes read per checkpoint tensor (in the dtype the loader hands over) and each
    tensor's whole size; ``fallbacks``: tensor name -> why a slice was read whole."""

    read: dict[str, int] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, nbytes: int, whole: int) -> None:
        self.read[name] = self.read.get(name, 0) + nbytes
        self.whole[name] = whole

    def summary(self) -> str:
        r, w = sum(self.read.values()), sum(self.whole.values())
        text = f"read {r / 2**20:.1f} of {w / 2**20:.1f} MiB of checkpoint tensors"
        if self.fallbacks:
            name, why = next(iter(self.fallbacks.items()))
            text += (f"; {len(self.fallbacks)} sliced tensor(s) read whole "
                     f"(e.g. {name}: {why})")
        return text


class LazyWeight:
    """A checkpoint tensor of ``shape``/``dtype`` read when used (see the module doc).
    ``read_slice`` reads one ``narrow``; ``read_whole`` the whole tensor."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 read_slice: SliceReader, read_whole: Callable[[], torch.Tensor],
                 counter: ReadCounter) -> None:
        self.name, self.shape, self.dtype = name, torch.Size(shape), dtype
        self._read_slice, self._read_whole, self._counter = read_slice, read_whole, counter
        self._whole: torch.Tensor | None = None
        self._nbytes = self.shape.numel() * dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.ndim
        if self._whole is None and not (start == 0 and length == self.shape[dim]):
            got = self._read_slice(dim, start, length)
            if isinstance(got, torch.Tensor):
                self._counter.add(self.name, got.numel() * got.element_size(), self._nbytes)
                return got
            self._counter.fallbacks[self.name] = got
            logger.debug("%s: slice read whole (%s)", self.name, got)
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        """The whole tensor (read once)."""
        if self._whole is None:
            self._whole = self._read_whole()
            self._counter.add(self.name, self._nbytes, self._nbytes)
        return self._whole

    def __getattr__(self, attr: str) -> Any:
        # Any tensor method other than narrow: on the whole tensor.
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.materialize(), attr)

    # Operators are looked up on the type, not through __getattr__.
    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.materialize()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __add__(self, other: Any) -> torch.Tensor:
        return self.materialize() + other

    def __mul__(self, other: Any) -> torch.Tensor:
        return self.materialize() * other

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        """A torch function given a ``LazyWeight`` (``param.copy_(w)``, ``torch.cat``)
        runs on the whole tensor."""
        def whole(a: Any) -> Any:
            if isinstance(a, LazyWeight):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(whole(x) for x in a)
            return a

        return func(*whole(tuple(args)), **{k: whole(v) for k, v in (kwargs or {}).items()})
