"""``core.prefill_pacing.fill_sizes``: which chunk sizes the throughput policy fills.

The two curves are the chunk CUDA graphs' replay times (ms) that the engine measured at
start-up on an H100 (2026-12-07, Llama-3-8B shape, dummy weights): bf16, and int4
(W4A16, group 128), whose layers take the tensor-core kernel up to 256 rows and
dequantise + cuBLAS above.  W1 with these fill sizes: int4 6,797 output tok/s against
6,421 with every size, bf16 8,594 against 8,589 (docs/benchmarks.md).
"""

from __future__ import annotations

from pagedllm.core.prefill_pacing import fill_sizes

SIZES = (8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 896, 1024, 1280, 1536,
         1792, 2048)
BF16 = (5.71, 5.72, 5.81, 5.92, 6.21, 6.38, 6.91, 7.52, 8.71, 9.50, 10.59, 13.26, 16.01,
        20.09, 19.52, 25.88, 33.66, 36.87, 39.45)
INT4 = (4.32, 4.26, 4.38, 4.63, 6.18, 6.46, 11.45, 12.03, 15.15, 15.99, 17.04, 19.77, 22.13,
        26.38, 25.76, 31.28, 38.09, 42.34, 46.59)


def test_bf16_keeps_the_sizes_its_w1_steps_use() -> None:
    # near-convex: only sizes costing over 5% above the hull's chord go (320, 768, 896...)
    assert fill_sizes(list(zip(SIZES, BF16))) == [8, 16, 32, 64, 96, 128, 192, 256, 384,
                                                 512, 640, 1024, 2048]


def test_int4_fills_past_the_kernel_switch() -> None:
    # 192-896 cost nearly what 1,024 does: a mixed step fills up to 1,024 tokens
    assert fill_sizes(list(zip(SIZES, INT4))) == [8, 16, 32, 64, 1024, 1280, 1792, 2048]


def test_margin_keeps_sizes_near_the_chord() -> None:
    costs = [(256, 10.0), (384, 15.4), (512, 20.0)]  # 384 is 2.7% above the chord
    assert fill_sizes(costs) == [256, 384, 512]
    assert fill_sizes(costs, margin=0.0) == [256, 512]
    assert fill_sizes([(8, 1.0)]) == [8] and fill_sizes([]) == []
