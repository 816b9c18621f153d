"""The model's own transformers processor, run in the front end (never in the core loop).

``MultiModalProcessor.process`` turns a prompt (text with the model's image token once
per image, or token ids with every image's placeholder run already expanded) and its
images into the expanded prompt token ids and one ``MultiModalFeature`` per image: its
placeholder run, a content identifier, and its processed tensors.  The processor is
loaded from the checkpoint directory (``AutoProcessor``) at the first image, and returns
numpy arrays (no torch here).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from pagedllm.multimodal.hashing import tensors_identifier
from pagedllm.multimodal.hf_processor import load_hf_processor, split_per_image
from pagedllm.multimodal.inputs import MultiModalFeature, TensorData

# Processor outputs that are per prompt, not per image.
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


def image_token_id_of(hf_config: Any) -> int | None:
    """The placeholder token id of a vision-language config (None: text only)."""
    for name in ("image_token_id", "image_token_index"):
        v = getattr(hf_config, name, None)
        if isinstance(v, int):
            return v
    return None


class MultiModalProcessor:
    """Images -> placeholder runs and tensors, for one model (thread-safe)."""

    def __init__(self, directory: str, hf_config: Any, trust_remote_code: bool = False,
                 ) -> None:
        self.directory = directory
        self.image_token_id = image_token_id_of(hf_config)
        self.trust_remote_code = trust_remote_code
        self._hf: Any = None
        self._lock = threading.Lock()

    @property
    def hf_processor(self) -> Any:
        with self._lock:
            if self._hf is None:
                try:
                    self._hf = load_hf_processor(self.directory, self.trust_remote_code)
                except (OSError, ValueError, ImportError) as e:
                    raise ValueError(f"multi_modal_data: the model has no usable processor "
                                     f"in {self.directory} ({type(e).__name__})") from None
            return self._hf

    def process(self, prompt: str | Sequence[int], images: list[Image.Image],
                add_special_tokens: bool = True,
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """(expanded prompt ids, features); ``ValueError`` naming ``multi_modal_data``
        when the images and the prompt's image tokens do not match.  A text prompt is
        tokenised by the processor (``add_special_tokens`` as for a text prompt)."""
        hf = self.hf_processor
        try:
            if isinstance(prompt, str):
                out = hf(text=prompt, images=images, return_tensors="np",
                         add_special_tokens=add_special_tokens)
                ids = [int(t) for t in out["input_ids"][0]]
            else:
                out = hf.image_processor(images=images, return_tensors="np")
                ids = list(prompt)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"multi_modal_data: the processor rejected the input: "
                             f"{str(e).splitlines()[0][:300]}") from None
        counts = self._tokens_per_image(hf, images)
        runs = self._placeholder_runs(ids, counts)
        if len(runs) != len(images):
            raise ValueError(f"multi_modal_data: {len(images)} image(s) but {len(runs)} "
                             "placeholder run(s) in the prompt; put the model's image "
                             "token in the prompt once per image")
        tensors = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS}
        features = []
        for (offset, length), per_image in zip(runs, split_per_image(tensors, len(images))):
            features.append(MultiModalFeature(
                "image", tensors_identifier("image", per_image), offset, length,
                {k: TensorData.from_numpy(v) for k, v in per_image.items()}))
        return ids, features

    @staticmethod
    def _tokens_per_image(hf: Any, images: list[Image.Image]) -> list[int] | None:
        """Placeholder tokens each image expands to, when the processor says (it splits
        adjacent images' runs); None otherwise."""
        fn = getattr(hf, "_get_num_multimodal_tokens", None)
        if fn is None:
            return None
        try:
            data = fn(image_sizes=[(im.height, im.width) for im in images])
        except (TypeError, ValueError, AttributeError, KeyError):
            return None
        n = getattr(data, "num_image_tokens", None)
        if n is None and isinstance(data, dict):
            n = data.get("num_image_tokens")
        return [int(x) for x in n] if n is not None else None

    def _placeholder_runs(self, ids: list[int], counts: list[int] | None,
                          ) -> list[tuple[int, int]]:
        """``(offset, length)`` of each image's placeholder run in ``ids``."""
        tok = self.image_token_id
        arr = np.asarray(ids)
        pos = np.nonzero(arr == tok)[0]
        # Contiguous runs of the image token.
        runs: list[tuple[int, int]] = []
        if len(pos):
            breaks = np.nonzero(np.diff(pos) != 1)[0]
            starts = np.concatenate([[0], breaks + 1])
            ends = np.concatenate([breaks + 1, [len(pos)]])
            runs = [(int(pos[s]), int(e - s)) for s, e in zip(starts, ends)]
        if counts is None:
            expected = None
        else:
            expected = sum(counts)
            # Adjacent images form one run: split it by the images' token counts.
            split: list[tuple[int, int]] = []
            queue = list(counts)
            for off, length in runs:
                while length > 0 and queue and queue[0] <= length:
                    n = queue.pop(0)
                    split.append((off, n))
                    off, length = off + n, length - n
                if length:
                    split.append((off, length))  # mismatch: reported below
            runs = split
        n_images = len(counts) if counts is not None else None
        if (expected is not None and (len(pos) != expected or len(runs) != n_images)):
            raise ValueError(
                f"multi_modal_data: {n_images} image(s) need {expected} placeholder "
                f"tokens ({counts}), the prompt has {len(pos)} in {len(runs)} run(s); "
                "put the model's image token in the prompt once per image")
        return runs
