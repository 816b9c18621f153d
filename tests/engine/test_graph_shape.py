"""Which CUDA graph a step replays (``worker/cuda_graphs.graph_key``): decode-only steps
pad to the next captured batch size, a lone prompt chunk pads to the next captured prompt
size, everything else (several requests with a prompt chunk, or too large) is eager."""

from __future__ import annotations

from pagedllm.worker.cuda_graphs import (
    capture_sizes,
    graph_key,
    prompt_capture_sizes,
)


def test_graph_key_picks_the_smallest_captured_shape() -> None:
    dec = capture_sizes(256)
    assert dec[:5] == [1, 2, 4, 8, 16] and dec[-1] == 256
    pro = prompt_capture_sizes(8192, 4096)
    assert pro[0] == 8 and pro[-1] == 1024
    assert graph_key(dec, pro, 1, 1, 1) == (1, 1)
    assert graph_key(dec, pro, 3, 3, 1) == (4, 4)
    assert graph_key(dec, pro, 200, 200, 1) == (200, 200)
    assert graph_key(dec, pro, 257, 257, 1) is None  # more requests than captured
    assert graph_key(dec, pro, 2, 1, 2) == (1, 8)  # lone prompt chunk
    assert graph_key(dec, pro, 512, 1, 512) == (1, 512)  # W4's prompt: no padding
    assert graph_key(dec, pro, 513, 1, 513) == (1, 640)
    assert graph_key(dec, pro, 1025, 1, 1025) is None  # GPU-bound: eager
    assert graph_key(dec, pro, 10, 2, 9) is None  # a prompt chunk with a decode: eager
    assert graph_key(dec, pro, 300, 5, 100) is None


def test_prompt_sizes_respect_the_token_budget_and_model_length() -> None:
    assert prompt_capture_sizes(256, 4096)[-1] == 256
    assert prompt_capture_sizes(8192, 100)[-1] == 96
    assert prompt_capture_sizes(4, 4096) == []
