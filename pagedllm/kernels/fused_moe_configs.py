"""Launch table of the sorted fused-MoE GEMMs (``kernels/fused_moe.py``).

``CONFIGS[(E, I, H)]`` maps a token count ``T`` to ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
num_warps, num_stages)``; a call uses the entry whose ``T`` is nearest (vLLM's rule).
``BLOCK_N`` counts output features of one program in vLLM's sense: the gate-up kernel
takes ``BLOCK_N / 2`` gate and ``BLOCK_N / 2`` up columns (the same MMA work as vLLM's
``BLOCK_N`` columns of ``[gate | up]``), the down kernel ``BLOCK_N`` hidden columns.

The defaults are vLLM's tuned H200 tables for the same expert shapes
(``vllm/model_executor/layers/fused_moe/configs/E=128,N=768,device_name=NVIDIA_H200.json``
and ``E=8,N=14336,...``), thinned to a few distinct entries: every distinct entry is
another compile of both kernels, paid at start-up.  ``python
benchmarks/moe_bench.py --sweep`` times candidates on the device and prints a
replacement table for this file.  Shapes not listed fall back to
:func:`default_config`.  ``DECODE_CONFIGS`` does the same for the GEMV decode path
(``kernels/fused_moe_decode.py``).
"""

from __future__ import annotations

from typing import NamedTuple

Config = tuple[int, int, int, int, int, int]

CONFIGS: dict[tuple[int, int, int], dict[int, Config]] = {
    # Qwen3-30B-A3B: 128 experts, I 768, H 2048 (vLLM E=128,N=768, H200).
    (128, 768, 2048): {
        16: (16, 64, 128, 1, 4, 3),
        64: (16, 128, 128, 1, 4, 2),
        256: (32, 256, 128, 16, 4, 2),
        512: (32, 256, 64, 1, 8, 4),  # H200 sweep 2026-12-06: 375 us (vLLM's 64x128: 448)
        1024: (128, 256, 64, 16, 8, 4),
    },
    # Mixtral-8x7B: 8 experts, I 14336, H 4096 (vLLM E=8,N=14336, H200).
    (8, 14336, 4096): {
        8: (16, 128, 128, 1, 4, 5),
        32: (16, 128, 128, 16, 8, 3),
        64: (32, 128, 128, 16, 4, 3),
        128: (64, 128, 128, 1, 8, 4),
        256: (128, 256, 64, 16, 8, 4),
    },
    # DeepSeek-V2-Lite: 64 experts, I 1408, H 2048 (no vLLM table for it): `python
    # benchmarks/moe_bench.py --shapes deepseek-v2-lite --sweep` on one H100
    # (2026-12-05); the comment gives the whole call, graph-timed, against the
    # default_config fallback it replaces.  The same sweep on an H200 (2026-12-07)
    # found no entry more than 3% faster (512 tokens: 332 against 340 us).
    (64, 1408, 2048): {
        16: (16, 128, 128, 1, 4, 3),  # 328 us (was 364)
        64: (16, 128, 128, 1, 8, 4),  # 407 us (was 442)
        256: (32, 128, 128, 1, 4, 3),  # 422 us (was 464)
        512: (64, 128, 128, 16, 8, 4),  # 444 us (was 624)
        1024: (64, 256, 64, 16, 8, 4),  # 522 us (was 629)
        4096: (128, 256, 64, 16, 8, 4),  # 1003 us (was 1550)
    },
}


class DecodeConfig(NamedTuple):
    """Launch parameters of the decode (GEMV) path, ``kernels/fused_moe_decode.py``.

    ``gate_up_block_n`` gate rows (and as many up rows) per program, reading
    ``gate_up_block_k`` columns of ``H`` per step (``H``'s next power of two: the whole
    row in one step, every load in flight at once); ``down_block_n`` output features
    per program, ``down_block_k`` columns of ``I`` per step.  ``down_all_slots``: the
    down kernel loads one ``[k, BLOCK_N, BLOCK_K]`` tile of all ``k`` routed experts per
    step (and its first step before the PDL wait) instead of looping over the slots.
    ``route_in_kernel``: with the all-slots kernel, ``FusedMoE`` computes the top-k
    inside both kernels (no routing launch) instead of launching ``fused_topk`` first."""

    gate_up_block_n: int
    gate_up_block_k: int
    gate_up_warps: int
    down_block_n: int
    down_block_k: int
    down_warps: int
    down_all_slots: bool
    route_in_kernel: bool = True


# The decode path, per (E, I, H): token count T -> DecodeConfig (the entry with the
# nearest T, as ``get_config``).  Shapes not listed get ``fused_moe_decode``'s heuristic;
# ``moe_bench --sweep`` times candidates at T = 1, 2, 4, 8 and prints entries.
DECODE_CONFIGS: dict[tuple[int, int, int], dict[int, DecodeConfig]] = {
    # `python benchmarks/moe_bench.py --sweep --decode-only --shapes
    # qwen3-30b-a3b` on one H200 (2026-12-02); the whole layer call under graph replay.
    # The K split of every reduction is the same at each T (gate-up 2048, down 256), so
    # a token's sums do not depend on how many tokens share the step.
    (128, 768, 2048): {  # qwen3-30b-a3b
        1: DecodeConfig(4, 2048, 4, 8, 256, 4, True, False),  # 23.2 us (heuristic 39.2)
        2: DecodeConfig(4, 2048, 4, 4, 256, 4, True, False),  # 39.9 us (heuristic 67.3)
        4: DecodeConfig(4, 2048, 4, 4, 256, 4, True, False),  # 69.4 us (heuristic 124.9)
        8: DecodeConfig(4, 2048, 4, 4, 256, 4, True, False),  # 120.2 us (heuristic 234.9)
    },
    # DeepSeek-V2-Lite, the same sweep on one H100 (2026-12-05): in-kernel routing
    # timed slower than the routing launch here (the 6-of-64 softmax top-k in both
    # kernels' prologue).  Down K split 256 at every T, as above.
    (64, 1408, 2048): {
        1: DecodeConfig(2, 1024, 4, 4, 256, 8, True, False),  # 39.2 us (heuristic 53.9)
        2: DecodeConfig(2, 1024, 4, 4, 256, 8, True, False),  # 70.8 us (heuristic 90.4)
        4: DecodeConfig(2, 1024, 4, 4, 256, 8, True, False),  # 124.6 us (heuristic 166.8)
        8: DecodeConfig(2, 1024, 4, 4, 256, 8, True, False),  # 203.6 us (heuristic 291.7)
    },
}


def get_decode_config(tokens: int, num_experts: int, inter: int,
                      hidden: int) -> DecodeConfig | None:
    """The swept decode config for ``tokens`` tokens on an ``(E, I, H)`` bank, if any."""
    table = DECODE_CONFIGS.get((num_experts, inter, hidden))
    if not table:
        return None
    return table[min(table, key=lambda m: abs(m - tokens))]


def default_config(tokens: int, num_experts: int, top_k: int) -> Config:
    """vLLM's fallback rule: small M tiles while experts get few pairs each."""
    pairs_per_expert = tokens * top_k / max(1, num_experts)
    if pairs_per_expert <= 16:
        return (16, 64, 64, 1, 4, 3)
    if pairs_per_expert <= 64:
        return (32, 64, 64, 8, 4, 3)
    return (64, 128, 64, 8, 8, 3)


def get_config(tokens: int, num_experts: int, inter: int, hidden: int,
               top_k: int) -> Config:
    """The launch config for ``tokens`` tokens on an ``(E, I, H)`` expert bank."""
    table = CONFIGS.get((num_experts, inter, hidden))
    if not table:
        return default_config(tokens, num_experts, top_k)
    return table[min(table, key=lambda m: abs(m - tokens))]
