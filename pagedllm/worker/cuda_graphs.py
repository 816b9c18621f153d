"""CUDA graphs: capture the model forward once per padded shape, then replay it with the
step's inputs copied into static buffers.

```
 decode step, n requests x 1 token ──► smallest captured batch size bs >= n
 lone prompt chunk of n tokens      ──► smallest captured prompt size T >= n
   static buffers[:n] <- inputs          static buffers[n:bs or T] <- padding
   (ids 0, positions 0, slot -1 = no write, seq_len 1, block table row = null block)
   graph.replay()  ──► hidden[:n]
```

Two families of graphs share one memory pool:

* **decode**: every request has exactly one new token (the steady state of serving);
* **lone prompt chunk**: one request with several new tokens and nothing else in the
  step -- a single user's prompt (W4's TTFT) or a chunk of it.  Eagerly such a step costs
  ~15 ms of host time for ~330 kernel launches on a Llama-3-8B shape, more than the GPU
  needs for a 512-token prompt; replayed it costs the GPU time alone.  Sizes stop at 1024
  tokens, where the GPU time outgrows the host's.

Other steps (several requests, some with prompt chunks) run eagerly.  The attention
backend's launch grids depend only on host ints (number of requests, number of tokens,
whether the step is decode-only), never on sequence lengths or on where a chunk starts,
so one graph per shape serves every context length.
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

# Prompt-chunk sizes captured (those <= max_num_batched_tokens and max_model_len).
PROMPT_SIZES = (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024)

GraphKey = tuple[int, int]  # (requests, tokens) it was captured for


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs and max_num_seqs > 4:
        sizes.append(max_num_seqs)
    return sizes


def prompt_capture_sizes(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    cap = min(max_num_batched_tokens, max_model_len)
    return [s for s in PROMPT_SIZES if s <= cap]


def graph_key(decode_sizes: list[int], prompt_sizes: list[int], num_tokens: int,
              num_reqs: int, max_query_len: int) -> GraphKey | None:
    """Which captured graph a step of ``num_tokens`` tokens over ``num_reqs`` requests
    replays: ``(bs, bs)`` for a decode-only step of <= bs requests, ``(1, T)`` for a
    lone prompt chunk of <= T tokens, None (eager) for anything else or too large."""
    if max_query_len == 1 and num_tokens == num_reqs:
        return next(((s, s) for s in decode_sizes if s >= num_reqs), None)
    if num_reqs == 1:
        return next(((1, t) for t in prompt_sizes if t >= num_tokens), None)
    return None


class CudaGraphRunner:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_blocks_per_req: int, block_size: int, max_model_len: int,
                 hidden_size: int, dtype: torch.dtype,
                 max_num_batched_tokens: int = 0) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.prompt_sizes = prompt_capture_sizes(max_num_batched_tokens, max_model_len)
        n = self.sizes[-1]
        tokens = max([n, *self.prompt_sizes])
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(tokens, dtype=i64, device=device)
        self.positions = torch.zeros(tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        self.prompt_qsl = torch.tensor([0, 1], dtype=i32, device=device)  # [0, n]
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=i32, device=device)
        # Pinned staging: one host->device copy per buffer per step, never a sync; two
        # sets used on alternate steps so a step in flight keeps its own.
        self._staging = [self._make_staging(tokens, n, max_blocks_per_req) for _ in range(2)]
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = None
        self.hidden_size = hidden_size
        self.dtype = dtype

    @staticmethod
    def _make_staging(tokens: int, n: int, max_blocks: int) -> dict[str, torch.Tensor]:
        i32, i64 = torch.int32, torch.int64
        return {"ids": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "pos": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "slot": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "seq": torch.zeros(n, dtype=i32, pin_memory=True),
                "qsl": torch.zeros(2, dtype=i32, pin_memory=True),
                "bt": torch.zeros((n, max_blocks), dtype=i32, pin_memory=True)}

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        reqs, tokens = key
        if reqs == tokens:  # decode: request i is token i
            qsl, qsl_cpu = self.query_start_loc[:reqs + 1], torch.arange(reqs + 1,
                                                                           dtype=torch.int32)
        else:  # one prompt chunk of up to `tokens` tokens
            qsl, qsl_cpu = self.prompt_qsl, torch.tensor([0, tokens], dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=reqs, max_query_len=tokens // reqs,
            max_seq_len=self.max_model_len, query_start_loc=qsl,
            seq_lens=self.seq_lens[:reqs], block_tables=self.block_tables[:reqs],
            slot_mapping=self.slot_mapping[:tokens], query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=torch.ones(reqs, dtype=torch.int32), block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        # Largest first: later graphs reuse its pool.
        keys = [(1, t) for t in reversed(self.prompt_sizes)] + \
            [(bs, bs) for bs in reversed(self.sizes)]
        for key in keys:
            reqs, tokens = key
            if reqs != tokens:  # capture a whole-chunk prompt (no cached context)
                self.prompt_qsl[1] = tokens
                self.seq_lens[0] = tokens
            else:
                self.seq_lens.fill_(1)
            meta = self._meta(key)
            for _ in range(2):  # warm up (Triton autotune/compile) outside the graph
                self.model(self.input_ids[:tokens], self.positions[:tokens], meta)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(self.input_ids[:tokens], self.positions[:tokens], meta)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = g
            self.outputs[key] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for %d decode batch sizes (%s) and %d prompt-chunk "
                    "sizes (%s) in %.1f s", len(self.sizes), ",".join(map(str, self.sizes)),
                    len(self.prompt_sizes), ",".join(map(str, self.prompt_sizes)),
                    time.perf_counter() - t0)

    def padded_size(self, num_tokens: int, num_reqs: int,
                    max_query_len: int) -> GraphKey | None:
        """The captured shape this step replays, or None to run eagerly."""
        return graph_key(self.sizes, self.prompt_sizes, num_tokens, num_reqs, max_query_len)

    def run(self, inp: StepInputs, key: GraphKey,
            fix: Callable[[torch.Tensor], None] | None = None, parity: int = 0,
            ) -> torch.Tensor:
        """Replay the graph captured for ``key`` on this step's ``t <= tokens`` tokens of
        ``n <= reqs`` requests; ``fix`` patches the device input ids (in-flight tokens)
        before the replay."""
        reqs, tokens = key
        t, n = len(inp.input_ids), len(inp.seq_lens)
        nb = inp.block_tables.shape[1]
        h = self._staging[parity]
        h["ids"][:t] = torch.from_numpy(inp.input_ids)
        h["pos"][:t] = torch.from_numpy(inp.positions)
        h["slot"][:t] = torch.from_numpy(inp.slot_mapping)
        h["seq"][:n] = torch.from_numpy(inp.seq_lens)
        h["bt"][:n, :nb] = torch.from_numpy(np.ascontiguousarray(inp.block_tables))
        if tokens > t:
            h["ids"][t:tokens] = 0
            h["pos"][t:tokens] = 0
            h["slot"][t:tokens] = -1
        if reqs > n:
            h["seq"][n:reqs] = 1
            h["bt"][n:reqs, :nb] = 0
        self.input_ids[:tokens].copy_(h["ids"][:tokens], non_blocking=True)
        self.positions[:tokens].copy_(h["pos"][:tokens], non_blocking=True)
        self.slot_mapping[:tokens].copy_(h["slot"][:tokens], non_blocking=True)
        self.seq_lens[:reqs].copy_(h["seq"][:reqs], non_blocking=True)
        self.block_tables[:reqs, :nb].copy_(h["bt"][:reqs, :nb], non_blocking=True)
        if reqs != tokens:
            h["qsl"][0], h["qsl"][1] = 0, t
            self.prompt_qsl.copy_(h["qsl"], non_blocking=True)
        if fix is not None:
            fix(self.input_ids[:t])
        self.graphs[key].replay()
        return self.outputs[key][:t]
