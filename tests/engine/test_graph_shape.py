"""Which CUDA graph a step replays (``worker/cuda_graphs.graph_shape``): decode-only steps
pad to the next captured batch size; any other step pads to the next captured chunk size
(with room for ``min(T, max_num_seqs)`` requests); larger steps run eagerly."""

from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.cuda_graphs import (
    GRAPH_MEMORY_MARGIN,
    GraphShape,
    capture_sizes,
    chunk_capture_sizes,
    graph_memory_margin,
    graph_shape,
    keep_graph,
)


def test_graph_shape_picks_the_smallest_captured_shape() -> None:
    dec = capture_sizes(256)
    assert dec[:5] == [1, 2, 4, 8, 16] and dec[-1] == 256
    chunk = chunk_capture_sizes(8192, 4096)
    assert chunk[0] == 8 and chunk[-1] == 2048

    def shape(tokens: int, reqs: int, mql: int) -> GraphShape | None:
        return graph_shape(dec, chunk, 256, tokens, reqs, mql)

    assert shape(1, 1, 1) == GraphShape(1, 1, True)
    assert shape(3, 3, 1) == GraphShape(4, 4, True)
    assert shape(200, 200, 1) == GraphShape(200, 200, True)
    assert shape(2, 1, 2) == GraphShape(8, 8, False)  # lone prompt chunk
    assert shape(512, 1, 512) == GraphShape(256, 512, False)  # W4's prompt: no padding
    assert shape(513, 1, 513) == GraphShape(256, 640, False)
    assert shape(10, 2, 9) == GraphShape(16, 16, False)  # a decode and a prompt chunk
    assert shape(40 + 600, 41, 600) == GraphShape(256, 640, False)
    assert shape(1025, 1, 1025) == GraphShape(256, 1280, False)
    assert shape(30 + 2000, 31, 2000) == GraphShape(256, 2048, False)
    assert shape(2049, 1, 2049) is None  # GPU-bound: eager
    assert shape(8192, 200, 1024) is None


def test_chunk_sizes_respect_the_token_budget_and_model_length() -> None:
    assert chunk_capture_sizes(256, 4096)[-1] == 256
    assert chunk_capture_sizes(8192, 100)[-1] == 96
    assert chunk_capture_sizes(4, 4096) == []
    dec = capture_sizes(4)
    # With max_num_seqs 4 a chunk graph has 4 request slots.
    assert graph_shape(dec, [8, 16], 4, 12, 3, 10) == GraphShape(4, 16, False)


def test_max_cudagraph_capture_size_extends_the_chunk_ladder() -> None:
    """Above the 2,048-token default the ladder stays ~25% apart and reaches the W1 step
    budget exactly, so a full 8,192-token step pads nothing."""
    big = chunk_capture_sizes(8192, 8192, max_capture_size=8192)
    assert big[-1] == 8192 and big[:20] == chunk_capture_sizes(8192, 8192)
    assert all(b / a <= 1.34 for a, b in zip(big[16:], big[17:]))
    assert chunk_capture_sizes(8192, 8192, max_capture_size=0) == []
    assert chunk_capture_sizes(8192, 4096, max_capture_size=100_000)[-1] == 4096
    dec = capture_sizes(256)
    assert graph_shape(dec, big, 256, 8192, 13, 1000) == GraphShape(256, 8192, False)
    assert graph_shape(dec, big, 256, 5000, 40, 1000) == GraphShape(256, 5120, False)


def test_graph_memory_margin_scales_past_the_default() -> None:
    gib = 1 << 30
    # Up to 2,048 tokens: the fixed margin (the default plan is unchanged).
    assert graph_memory_margin(2 * gib, 8192, 2048) == GRAPH_MEMORY_MARGIN
    assert graph_memory_margin(2 * gib, 8192, 0) == GRAPH_MEMORY_MARGIN
    # Beyond: in proportion to the profiled activation peak, never below the fixed one.
    assert graph_memory_margin(2 * gib, 8192, 8192) == 2 * gib
    assert graph_memory_margin(2 * gib, 8192, 4096) == gib
    assert graph_memory_margin(gib // 4, 8192, 4096) == GRAPH_MEMORY_MARGIN


def test_max_cudagraph_capture_size_is_validated() -> None:
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineArgs(model=_model_dir(), load_format="dummy", skip_tokenizer_init=True,
                   max_cudagraph_capture_size=-1).create_engine_config()
    cfg = EngineArgs(model=_model_dir(), load_format="dummy", skip_tokenizer_init=True,
                     max_cudagraph_capture_size=8192).create_engine_config()
    assert cfg.device_config.max_cudagraph_capture_size == 8192


def _model_dir() -> str:
    from pagedllm.benchmarks.workloads import write_dummy_model

    return write_dummy_model("smollm2-135m")


def test_a_graph_no_faster_than_the_next_larger_is_not_kept() -> None:
    """A size whose forward took clearly longer (3%) than the next larger captured
    size's is dropped (its steps pad up); a tie within timing noise keeps it; the largest
    of each family and the batch-1 decode graph (the GEMV path) are always kept."""
    assert keep_graph(GraphShape(256, 2048, False), 40.0, None)
    assert keep_graph(GraphShape(256, 384, False), 8.3, 10.7)
    assert not keep_graph(GraphShape(256, 448, False), 13.7, 10.7)
    assert keep_graph(GraphShape(248, 248, True), 6.05, 6.0)
    assert not keep_graph(GraphShape(248, 248, True), 6.5, 6.0)
    assert keep_graph(GraphShape(1, 1, True), 4.5, 4.2)
