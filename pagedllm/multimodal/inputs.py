"""What a request carries per image from the front end to the model runner.

``MultiModalFeature`` holds the image's placeholder run in the (expanded) prompt,
``[offset, offset + length)``, a content ``identifier`` (the prefix cache and the encoder
cache key on it) and the processed tensors as ``TensorData`` -- dtype, shape and raw
bytes, so a request crosses ZeroMQ as msgpack without pickle and without torch.
"""

from __future__ import annotations

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """A dense array: numpy dtype name, shape, C-order bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> TensorData:
        a = np.ascontiguousarray(arr)
        return cls(str(a.dtype), list(a.shape), a.tobytes())

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One image of a request.

    ``offset``/``length``: its placeholder tokens in the prompt (the model's
    ``embed_multimodal`` returns exactly ``length`` rows for it).  ``identifier``: a hash
    of the processed tensors -- equal identifiers mean equal encoder outputs.
    ``data``: the processor's per-image tensors (``pixel_values``, ``image_sizes``...).
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, TensorData]

    @property
    def end(self) -> int:
        return self.offset + self.length


def overlapping(features: list[MultiModalFeature], start: int,
                end: int) -> list[tuple[int, MultiModalFeature]]:
    """``(index, feature)`` of the features whose placeholder run meets tokens
    ``[start, end)`` (features are sorted by offset and do not overlap)."""
    out = []
    for i, f in enumerate(features):
        if f.offset >= end:
            break
        if f.end > start:
            out.append((i, f))
    return out
