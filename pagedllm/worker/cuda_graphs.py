"""CUDA graphs for decode batches: capture the model forward once per padded batch size,
then replay it with the step's inputs copied into static buffers.

```
 step with n decode tokens ──► smallest captured size bs >= n
   static buffers[:n] <- inputs          static buffers[n:bs] <- padding
   (ids 0, positions 0, slot -1 = no write, seq_len 1, block table row = null block)
   graph[bs].replay()  ──► hidden[:n]
```

Only pure decode steps (every request has exactly one new token) replay graphs; prefill
chunks run eagerly.  The attention backend's launch grids depend only on host ints
(number of requests, max query length), never on sequence lengths, so one graph per batch
size serves every context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs and max_num_seqs > 4:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_blocks_per_req: int, block_size: int, max_model_len: int,
                 hidden_size: int, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=i32, device=device)
        # Pinned staging: one host->device copy per buffer per step, never a sync; two
        # sets used on alternate steps so a step in flight keeps its own.
        self._staging = [self._make_staging(n, max_blocks_per_req) for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.hidden_size = hidden_size
        self.dtype = dtype

    @staticmethod
    def _make_staging(n: int, max_blocks: int) -> dict[str, torch.Tensor]:
        i32, i64 = torch.int32, torch.int64
        return {"ids": torch.zeros(n, dtype=i64, pin_memory=True),
                "pos": torch.zeros(n, dtype=i64, pin_memory=True),
                "slot": torch.zeros(n, dtype=i64, pin_memory=True),
                "seq": torch.zeros(n, dtype=i32, pin_memory=True),
                "bt": torch.zeros((n, max_blocks), dtype=i32, pin_memory=True)}

    def _meta(self, bs: int) -> AttentionMetadata:
        qsl_cpu = torch.arange(bs + 1, dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=bs, num_reqs=bs, max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs], query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=torch.ones(bs, dtype=torch.int32), block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
            meta = self._meta(bs)
            for _ in range(2):  # warm up (Triton autotune/compile) outside the graph
                self.model(self.input_ids[:bs], self.positions[:bs], meta)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for %d decode batch sizes (%s) in %.1f s",
                    len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - t0)

    def padded_size(self, num_tokens: int, num_reqs: int, max_query_len: int) -> int | None:
        """The captured size this step replays, or None to run eagerly."""
        if max_query_len != 1 or num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(self, inp: StepInputs, bs: int,
            fix: Callable[[torch.Tensor], None] | None = None, parity: int = 0,
            ) -> torch.Tensor:
        """Replay the graph of size ``bs`` on this step's ``n <= bs`` decode tokens;
        ``fix`` patches the device input ids (in-flight tokens) before the replay."""
        n = len(inp.seq_lens)
        nb = inp.block_tables.shape[1]
        h = self._staging[parity]
        h["ids"][:n] = torch.from_numpy(inp.input_ids)
        h["pos"][:n] = torch.from_numpy(inp.positions)
        h["slot"][:n] = torch.from_numpy(inp.slot_mapping)
        h["seq"][:n] = torch.from_numpy(inp.seq_lens)
        h["bt"][:n, :nb] = torch.from_numpy(np.ascontiguousarray(inp.block_tables))
        if bs > n:
            h["ids"][n:bs] = 0
            h["pos"][n:bs] = 0
            h["slot"][n:bs] = -1
            h["seq"][n:bs] = 1
            h["bt"][n:bs, :nb] = 0
        self.input_ids[:bs].copy_(h["ids"][:bs], non_blocking=True)
        self.positions[:bs].copy_(h["pos"][:bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(h["slot"][:bs], non_blocking=True)
        self.seq_lens[:bs].copy_(h["seq"][:bs], non_blocking=True)
        self.block_tables[:bs, :nb].copy_(h["bt"][:bs, :nb], non_blocking=True)
        if fix is not None:
            fix(self.input_ids[:n])
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
