"""Loading a checkpoint's transformers processor, and cutting its outputs per image.

``load_hf_processor``: ``AutoProcessor.from_pretrained``; when that fails and the
processor has a *video* part -- which needs a backend that may not be installed
(transformers' Qwen2-VL video processor requires torchvision) or a config the checkpoint
may not ship -- the same processor class is built without its video processor: images
and text behave exactly as in the full one, and this engine takes no videos.

``split_per_image``: a processor returns some tensors with one row per image
(``image_grid_thw``, LLaVA's ``pixel_values``) and, for dynamic-resolution models, the
patches of every image concatenated (Qwen2-VL's ``pixel_values [sum of t*h*w, ...]``);
the latter is cut by each image's ``image_grid_thw`` product.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _images_only(cls: type) -> type:
    """``cls`` whose constructor has no video processor (transformers derives a
    processor's parts from its ``__init__`` signature)."""

    class ImagesOnlyProcessor(cls):  # type: ignore[misc,valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: Any = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, chat_template=chat_template,
                             **kwargs)

    ImagesOnlyProcessor.__name__ = ImagesOnlyProcessor.__qualname__ = cls.__name__
    return ImagesOnlyProcessor


def load_hf_processor(directory: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's processor (see the module doc); raises what ``AutoProcessor``
    raises when the fallback does not apply."""
    from transformers import AutoConfig, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (ImportError, OSError) as e:  # no backend for, or no config of, its videos
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

        try:
            config = AutoConfig.from_pretrained(directory,
                                                trust_remote_code=trust_remote_code)
            cls = PROCESSOR_MAPPING[type(config)]
        except (KeyError, OSError, ValueError):
            raise e from None
        if "video_processor" not in cls.get_attributes():
            raise
        return _images_only(cls).from_pretrained(directory)


def split_per_image(tensors: dict[str, np.ndarray], num_images: int,
                    ) -> list[dict[str, np.ndarray]]:
    """One dict per image: rows ``i`` of per-image tensors, image ``i``'s patches of
    concatenated ones (by ``image_grid_thw``), whole tensors otherwise."""
    grid = tensors.get("image_grid_thw")
    patches = None
    if grid is not None and grid.ndim == 2 and grid.shape[0] == num_images:
        counts = grid.prod(-1)
        patches = (int(counts.sum()), np.concatenate([[0], np.cumsum(counts)]))
    out: list[dict[str, np.ndarray]] = [{} for _ in range(num_images)]
    for k, v in tensors.items():
        for i in range(num_images):
            if patches is not None and k != "image_grid_thw" and v.ndim \
                    and v.shape[0] == patches[0]:
                out[i][k] = v[patches[1][i]:patches[1][i + 1]]
            elif v.ndim and v.shape[0] == num_images:
                out[i][k] = v[i]
            else:
                out[i][k] = v
    return out
