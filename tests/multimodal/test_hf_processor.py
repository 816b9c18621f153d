"""``split_per_image``: per-image rows, patch-concatenated tensors cut by
``image_grid_thw`` (Qwen2-VL), whole tensors otherwise."""

from __future__ import annotations

import numpy as np

from pagedllm.multimodal.hf_processor import split_per_image


def test_patches_cut_by_grid_rows_per_image():
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    pixels = np.arange(28 * 3).reshape(28, 3)
    parts = split_per_image({"pixel_values": pixels, "image_grid_thw": grid,
                             "scale": np.float32(2.0)}, 2)
    assert np.array_equal(parts[0]["pixel_values"], pixels[:24])
    assert np.array_equal(parts[1]["pixel_values"], pixels[24:])
    assert [p["image_grid_thw"].tolist() for p in parts] == [[1, 4, 6], [1, 2, 2]]
    assert all(p["scale"] == 2.0 for p in parts)


def test_one_row_per_image_without_a_grid():
    pixels = np.zeros((2, 3, 8, 8))
    sizes = np.array([[8, 8], [9, 7]])
    parts = split_per_image({"pixel_values": pixels, "image_sizes": sizes}, 2)
    assert parts[0]["pixel_values"].shape == (3, 8, 8)
    assert parts[1]["image_sizes"].tolist() == [9, 7]
