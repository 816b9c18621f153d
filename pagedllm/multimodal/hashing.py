"""Content identifiers of processed images, and what they add to a KV block's hash.

Two images with equal processed tensors give equal encoder outputs, so the identifier
hashes exactly those tensors (names, dtypes, shapes, bytes).  A KV block's prefix-cache
hash covers its token ids; the placeholder tokens of every image are the same id, so the
block's key also names the identifiers of the images whose placeholder runs meet it::

  tokens   [ t t <img><img><img> | <img><img> t t t | t t t t ]
  extra    [ (salt, (id_A,))     | (salt, (id_A,))   | salt    ]
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature, overlapping


def tensors_identifier(modality: str, tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over the modality and each tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(modality.encode())
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"|{name}|{a.dtype}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def block_extra_key(extra: object, features: list[MultiModalFeature], start: int,
                    end: int) -> object:
    """The prefix-cache extra key of the block of tokens ``[start, end)``: ``extra``
    alone when no image meets it, else ``extra`` with those images' identifiers."""
    ids = tuple(f.identifier for _, f in overlapping(features, start, end))
    return (extra, "mm", ids) if ids else extra
