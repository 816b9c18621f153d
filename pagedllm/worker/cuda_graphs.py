"""CUDA graphs: capture the model forward once per padded shape, then replay it with the
step's inputs copied into static buffers.

```
 decode step: n requests x 1 token  ──► decode graph of the smallest batch size bs >= n
 any other step of t <= max_cudagraph_capture_size tokens (2048 by default)
                                    ──► chunk graph of the smallest size T >= t
   static buffers[:t] <- inputs          static buffers[t:T] <- padding
   (ids 0, positions 0, slot -1 = no write; padded requests own no token)
   graph.replay()  ──► hidden[:t]  (a chunk graph captured last_only: hidden[:n], the
                                     n requests' last tokens)
```

Two families of graphs share one memory pool:

* **decode**: every request has exactly one new token (the steady state of serving);
  captured for batch sizes 1, 2, 4, 8, 16, ..., ``max_num_seqs``.
* **chunk**: steps with prompt chunks -- a lone prompt (W4's TTFT), or decodes plus a
  newly arrived prompt (most of W2's slow steps) -- captured for 8 ... 2048 tokens (up to
  ``max_cudagraph_capture_size``), each with room for ``min(T, max_num_seqs)`` requests.

  Eagerly such a step costs 15-65 ms of host time for ~330 kernel launches on a
  Llama-3-8B shape (65 ms measured under W2 for 1,035 tokens, whose GPU time is ~25 ms);
  replayed it costs the GPU time alone.  Larger steps run eagerly: on that shape their
  GPU time outgrows the host's from ~3,000 tokens.  A small model's GPU time does not
  (SmolLM2-135M's 8,192-token W1 steps: ~7 ms of GPU work, ~65 ms apart under the
  profiler), which is what a larger ``max_cudagraph_capture_size`` is for.

A size whose graph replay (timed at capture) is clearly slower than the next larger one's
is dropped (``keep_graph``): its steps pad up to the larger graph.

This works because the attention backend's launch grids depend only on host ints (the
number of tokens, the number of requests, whether the step is decode-only), never on
sequence lengths or on where a chunk starts: a chunk graph captured with ``R`` request
slots serves any step with up to ``R`` requests (the unused slots own no tokens, so
their programs exit at once), and one graph per shape serves every context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger("pagedllm")

# What the memory plan (worker.py) sets aside for the graphs' private memory pool with
# chunk graphs up to 2,048 tokens: the Llama-3-8B shape uses 360 MiB.  A capture that
# takes more than was set aside is logged as a warning (the 1 - gpu_memory_utilization
# headroom absorbs it).
GRAPH_MEMORY_MARGIN = 512 << 20
DEFAULT_MAX_CAPTURE_SIZE = 2048
# A graph size is dropped when its replay is this much slower than the next larger's.
PRUNE_MARGIN = 1.03

# Chunk-graph token counts captured (those <= max_num_batched_tokens, max_model_len and
# max_cudagraph_capture_size): about 25% apart, so padding wastes little.
CHUNK_SIZES = (8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
               1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
               10240, 12288, 14336, 16384)


class GraphShape(NamedTuple):
    """What a graph was captured for: ``reqs`` request slots, ``tokens`` token rows."""

    reqs: int
    tokens: int
    decode: bool  # decode-only (one token per request) or chunk


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs and max_num_seqs > 4:
        sizes.append(max_num_seqs)
    return sizes


def chunk_capture_sizes(max_num_batched_tokens: int, max_model_len: int,
                        max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> list[int]:
    cap = min(max_num_batched_tokens, max_model_len, max_capture_size)
    return [s for s in CHUNK_SIZES if s <= cap]


def graph_memory_margin(activation_peak: int, profiled_tokens: int,
                        largest_chunk: int) -> int:
    """Bytes the memory plan sets aside for the graphs' pool.  Graphs are captured
    largest first and share one pool, so it holds about the largest chunk graph's
    activations: up to 2,048 tokens the fixed margin covers them (measured above); beyond,
    the margin grows with the profiled activation peak of a ``profiled_tokens`` step, in
    proportion to the tokens (an overestimate: 2,048 tokens would get 0.58 GiB of the
    Llama-3-8B shape's 2.32 GiB peak at 8,192, and took 0.35 GiB)."""
    if largest_chunk <= DEFAULT_MAX_CAPTURE_SIZE:
        return GRAPH_MEMORY_MARGIN
    scaled = activation_peak * largest_chunk // max(profiled_tokens, 1)
    return max(GRAPH_MEMORY_MARGIN, int(scaled))


def keep_graph(shape: GraphShape, ms: float, larger_ms: float | None) -> bool:
    """Whether to keep ``shape``'s graph, whose replay took ``ms`` at capture (the faster
    of two), given the time of the next larger kept shape of its family (None: it is the
    largest).

    cuBLAS runs some row counts slower than larger ones (its heuristic's tile choice:
    on an H200 the Llama-3-8B shape's GEMMs took 13.7 ms per step at 448 rows against
    10.7 ms at 512), so such a step is padded up to the larger graph instead.  Only a
    clear loss counts (``PRUNE_MARGIN``): small batches all take about the weight-read
    time, and a bare "no faster" would drop sizes on timing noise.  The
    batch-1 decode graph is always kept: it is the only one that runs the GEMV path.
    """
    if larger_ms is None or (shape.decode and shape.reqs == 1):
        return True
    return ms <= larger_ms * PRUNE_MARGIN


def graph_shape(decode_sizes: list[int], chunk_sizes: list[int], max_num_seqs: int,
                num_tokens: int, num_reqs: int, max_query_len: int) -> GraphShape | None:
    """Which captured graph a step of ``num_tokens`` tokens over ``num_reqs`` requests
    replays: the decode graph of the smallest batch size >= ``num_reqs`` for a
    decode-only step, else the chunk graph of the smallest size >= ``num_tokens``;
    None (eager) when the step is larger than every captured shape."""
    if max_query_len == 1 and num_tokens == num_reqs:
        return next((GraphShape(s, s, True) for s in decode_sizes if s >= num_reqs), None)
    for t in chunk_sizes:
        if t >= num_tokens:
            reqs = min(t, max_num_seqs)
            return GraphShape(reqs, t, False) if num_reqs <= reqs else None
    return None


class CudaGraphRunner:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_blocks_per_req: int, block_size: int, max_model_len: int,
                 max_num_batched_tokens: int,
                 max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE,
                 memory_margin: int = GRAPH_MEMORY_MARGIN, last_only: bool = False,
                 num_kv_groups: int = 1, position_rows: int = 1,
                 chunk_graphs: bool = True) -> None:
        """``last_only``: chunk graphs run the model's ``last_only`` forward and return one
        row per request slot (each request's last token); decode graphs return one row per
        token either way (a decode token is its request's last).  ``num_kv_groups``:
        hybrid KV cache groups, each with its own static block tables and slot mapping.
        ``position_rows``: 3 for M-RoPE models (positions ``[3, T]``, ``layers/mrope.py``),
        else 1 (``[T]``).  ``chunk_graphs`` False: decode graphs only (a model whose
        prompt-chunk attention plans on the host); other steps run eagerly."""
        self.model = model
        self.last_only = last_only
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.memory_margin = memory_margin  # what the memory plan set aside
        self.sizes = capture_sizes(max_num_seqs)
        self.chunk_sizes = chunk_capture_sizes(max_num_batched_tokens, max_model_len,
                                               max_capture_size) if chunk_graphs else []
        n = self.sizes[-1]
        self.max_num_seqs = n
        tokens = max([n, *self.chunk_sizes])
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(tokens, dtype=i64, device=device)
        pos_shape = (tokens,) if position_rows == 1 else (position_rows, tokens)
        self.positions = torch.zeros(pos_shape, dtype=i64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)  # decode
        self.chunk_qsl = torch.zeros(n + 1, dtype=i32, device=device)  # set per step
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=i32, device=device)
        g = num_kv_groups - 1  # hybrid KV cache groups 1..
        self.group_slots = torch.full((g, tokens), -1, dtype=i64, device=device)
        self.group_tables = torch.zeros((g, n, max_blocks_per_req), dtype=i32, device=device)
        # Pinned staging: one host->device copy per buffer per step, never a sync; two
        # sets used on alternate steps so a step in flight keeps its own.
        self._staging = [self._make_staging(tokens, n, max_blocks_per_req, g)
                         for _ in range(2)]
        for h in self._staging if position_rows > 1 else ():
            h["pos"] = torch.zeros(pos_shape, dtype=i64, pin_memory=True)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphShape, torch.Tensor] = {}
        # Each kept graph's replay time at capture, ms (the speculation policy's step-cost
        # curve: worker/step_cost.py).
        self.replay_ms: dict[GraphShape, float] = {}
        self.pool = None

    @staticmethod
    def _make_staging(tokens: int, n: int, max_blocks: int,
                      groups: int = 0) -> dict[str, torch.Tensor]:
        i32, i64 = torch.int32, torch.int64
        return {"gslot": torch.zeros((groups, tokens), dtype=i64, pin_memory=True),
                "gbt": torch.zeros((groups, n, max_blocks), dtype=i32, pin_memory=True),
                "ids": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "pos": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "slot": torch.zeros(tokens, dtype=i64, pin_memory=True),
                "seq": torch.zeros(n, dtype=i32, pin_memory=True),
                "qsl": torch.zeros(n + 1, dtype=i32, pin_memory=True),
                "bt": torch.zeros((n, max_blocks), dtype=i32, pin_memory=True)}

    def _meta(self, shape: GraphShape) -> AttentionMetadata:
        reqs, tokens = shape.reqs, shape.tokens
        if shape.decode:  # request i is token i
            qsl = self.query_start_loc[:reqs + 1]
            qsl_cpu = torch.arange(reqs + 1, dtype=torch.int32)
        else:  # captured as one request owning every row; set per step
            qsl = self.chunk_qsl[:reqs + 1]
            qsl_cpu = torch.full((reqs + 1,), tokens, dtype=torch.int32)
            qsl_cpu[0] = 0
        meta = AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=reqs,
            max_query_len=1 if shape.decode else tokens,
            max_seq_len=self.max_model_len, query_start_loc=qsl,
            seq_lens=self.seq_lens[:reqs], block_tables=self.block_tables[:reqs],
            slot_mapping=self.slot_mapping[:tokens], query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=torch.ones(reqs, dtype=torch.int32), block_size=self.block_size,
            host_lens=False)
        return meta.with_groups([t[:reqs] for t in self.group_tables],
                                [s[:tokens] for s in self.group_slots])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved0 = torch.cuda.memory_reserved(self.device)
        # Largest first: later graphs reuse its pool.
        shapes = [GraphShape(min(t, self.max_num_seqs), t, False)
                  for t in reversed(self.chunk_sizes)]
        shapes += [GraphShape(bs, bs, True) for bs in reversed(self.sizes)]
        # Replay time of the last kept (next larger) shape of each family.
        larger: dict[bool, float] = {}
        pruned: list[GraphShape] = []
        for shape in shapes:
            tokens = shape.tokens
            self.seq_lens.fill_(1)
            if not shape.decode:  # capture one whole-chunk prompt (no cached context)
                self.chunk_qsl.fill_(tokens)
                self.chunk_qsl[0] = 0
                self.seq_lens[0] = tokens
            meta = self._meta(shape)
            last = self.last_only and not shape.decode
            for _ in range(2):  # warm up (Triton autotune/compile) outside the graph
                self.model(self.input_ids[:tokens], self.positions[..., :tokens], meta, last)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(self.input_ids[:tokens], self.positions[..., :tokens], meta,
                                 last)
            if self.pool is None:
                self.pool = g.pool()
            # Time two replays (GPU time: an eager forward's time is mostly its host's
            # launches), after one to warm up.
            g.replay()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            for ev in events[1:]:
                g.replay()
                ev.record()
            events[-1].synchronize()
            ms = min(a.elapsed_time(b) for a, b in zip(events, events[1:]))
            if not keep_graph(shape, ms, larger.get(shape.decode)):
                pruned.append(shape)  # its memory stays in the shared pool: small
                continue
            larger[shape.decode] = ms
            self.graphs[shape] = g
            self.outputs[shape] = out
            self.replay_ms[shape] = ms
        torch.cuda.synchronize(self.device)
        used = torch.cuda.memory_reserved(self.device) - reserved0
        self.sizes = [s for s in self.sizes if GraphShape(s, s, True) not in pruned]
        self.chunk_sizes = [t for t in self.chunk_sizes
                            if GraphShape(min(t, self.max_num_seqs), t, False) not in pruned]
        if pruned:
            logger.info("dropped graphs (a replay slower than the next larger graph's): "
                        "decode batch sizes %s, chunk sizes %s",
                        ",".join(str(p.reqs) for p in pruned if p.decode) or "none",
                        ",".join(str(p.tokens) for p in pruned if not p.decode) or "none")
        logger.info("captured CUDA graphs for %d decode batch sizes (%s) and %d chunk sizes "
                    "(%s tokens) in %.1f s, %.0f MiB", len(self.sizes),
                    ",".join(map(str, self.sizes)), len(self.chunk_sizes),
                    ",".join(map(str, self.chunk_sizes)), time.perf_counter() - t0,
                    used / 2**20)
        if used > self.memory_margin:
            logger.warning("CUDA graphs took %.0f MiB, more than the %.0f MiB the memory "
                           "plan set aside; lower --gpu-memory-utilization if memory runs "
                           "short", used / 2**20, self.memory_margin / 2**20)

    def padded_shape(self, num_tokens: int, num_reqs: int,
                    max_query_len: int) -> GraphShape | None:
        """The captured shape this step replays, or None to run eagerly."""
        return graph_shape(self.sizes, self.chunk_sizes, self.max_num_seqs, num_tokens,
                           num_reqs, max_query_len)

    def run(self, inp: StepInputs, shape: GraphShape,
            fix: Callable[[torch.Tensor], None] | None = None, parity: int = 0,
            ) -> torch.Tensor:
        """Replay the graph captured for ``shape`` on this step's ``t <= tokens`` tokens
        of ``n <= reqs`` requests; ``fix`` patches the device input ids (in-flight
        tokens) before the replay.  Returns the hidden states of the ``t`` tokens, or of
        the ``n`` requests' last tokens for a chunk graph captured ``last_only``."""
        reqs, tokens = shape.reqs, shape.tokens
        t, n = len(inp.input_ids), len(inp.seq_lens)
        nb = inp.block_tables.shape[1]
        h = self._staging[parity]
        h["ids"][:t] = torch.from_numpy(inp.input_ids)
        h["pos"][..., :t] = torch.from_numpy(inp.positions)
        h["slot"][:t] = torch.from_numpy(inp.slot_mapping)
        h["seq"][:n] = torch.from_numpy(inp.seq_lens)
        h["bt"][:n, :nb] = torch.from_numpy(np.ascontiguousarray(inp.block_tables))
        if tokens > t:
            h["ids"][t:tokens] = 0
            h["pos"][..., t:tokens] = 0
            h["slot"][t:tokens] = -1
        if reqs > n:
            h["seq"][n:reqs] = 1
            h["bt"][n:reqs, :nb] = 0
        if inp.group_block_tables is not None:  # hybrid KV cache groups 1..
            assert inp.group_slot_mapping is not None
            h["gslot"][:, :t] = torch.from_numpy(inp.group_slot_mapping)
            h["gslot"][:, t:tokens] = -1
            h["gbt"][:, :n, :nb] = torch.from_numpy(
                np.ascontiguousarray(inp.group_block_tables))
            h["gbt"][:, n:reqs, :nb] = 0
            self.group_slots[:, :tokens].copy_(h["gslot"][:, :tokens], non_blocking=True)
            self.group_tables[:, :reqs, :nb].copy_(h["gbt"][:, :reqs, :nb],
                                                   non_blocking=True)
        self.input_ids[:tokens].copy_(h["ids"][:tokens], non_blocking=True)
        self.positions[..., :tokens].copy_(h["pos"][..., :tokens], non_blocking=True)
        self.slot_mapping[:tokens].copy_(h["slot"][:tokens], non_blocking=True)
        self.seq_lens[:reqs].copy_(h["seq"][:reqs], non_blocking=True)
        self.block_tables[:reqs, :nb].copy_(h["bt"][:reqs, :nb], non_blocking=True)
        if not shape.decode:
            # The unused request slots start (and end) at row t: they own no tokens.
            h["qsl"][:n + 1] = torch.from_numpy(inp.query_start_loc)
            h["qsl"][n + 1:reqs + 1] = t
            self.chunk_qsl[:reqs + 1].copy_(h["qsl"][:reqs + 1], non_blocking=True)
        if fix is not None:
            fix(self.input_ids[:t])
        self.graphs[shape].replay()
        return self.outputs[shape][:n if self.last_only and not shape.decode else t]
