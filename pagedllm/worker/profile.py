"""Profile the activation peak of the largest step the scheduler can send.

One forward of ``max_num_batched_tokens`` tokens spread over ``min(max_num_seqs, T)``
requests (all prefill, so attention does its largest work), logits for every request and
a full random-sampling pass, against a temporary KV cache just big enough for it.  The
peak of ``torch.cuda.max_memory_allocated`` is what the KV cache must leave room for.

``warm_logits_and_sampling`` runs the same logits and sampling work once more after the
graphs are captured, at every batch size, so no serving step pays a first launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, SchedulerConfig


class Worker(Protocol):
    """What profiling reads from ``worker.worker.Worker`` (a protocol, so this module
    does not import the worker that calls it)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's element type (fp8 with kv_cache_dtype="fp8")
    num_local_kv_heads: int  # this rank's KV heads (tensor parallel)
    local_layers: tuple[int, int]  # this rank's layer range (pipeline parallel)
    model: Any  # the loaded model: forward, compute_logits, bind_kv_caches


class _DummyReq:
    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.params = params
        self.generator = None
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.eos_token_id = None


# Random sampling with every truncation on: the sampler's largest working set.
_RANDOM = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=1)


def _sample_every_row(logits: torch.Tensor, params: SamplingParams, vocab_size: int) -> None:
    states = [_DummyReq(params, [1]) for _ in range(logits.shape[0])]
    Sampler()(logits, SamplingMetadata.build(states, logits.device, vocab_size))


def profile_tokens(sc: SchedulerConfig, max_model_len: int) -> int:
    """Tokens of the maximal step ``profile_run`` profiles."""
    return min(sc.max_num_batched_tokens, sc.max_num_seqs * max_model_len)


@torch.inference_mode()
def profile_run(worker: Worker) -> int:
    """Returns the peak bytes allocated on the worker's GPU during a maximal step."""
    mc, cc, sc = worker.config.model_config, worker.config.cache_config, \
        worker.config.scheduler_config
    dev = worker.device
    total = profile_tokens(sc, mc.max_model_len)
    reqs = min(sc.max_num_seqs, total)
    per = np.full(reqs, total // reqs, dtype=np.int64)
    per[: total % reqs] += 1
    bs = cc.block_size
    blocks_per_req = int(-(-per.max() // bs))
    num_blocks = reqs * blocks_per_req + 1
    shape = (mc.kv_entries_per_token, num_blocks, bs, worker.num_local_kv_heads,
             mc.head_dim)
    start, end = worker.local_layers  # this rank's share (tensor / pipeline parallel)
    caches = [torch.zeros(shape, dtype=worker.kv_dtype, device=dev)
              for _ in range(start, end)]
    worker.model.bind_kv_caches(caches)
    batch = InputBatch(reqs, int(per.max()) + 1, bs)
    rng = np.random.default_rng(0)
    for r in range(reqs):
        ids = rng.integers(0, mc.vocab_size, int(per[r])).tolist()
        blocks = list(range(1 + r * blocks_per_req, 1 + (r + 1) * blocks_per_req))
        batch.add(str(r), ids, blocks)
    rows = np.arange(reqs)
    inp = batch.prepare(rows, np.zeros(reqs, dtype=np.int64), per)
    from pagedllm.attention.metadata import AttentionMetadata

    def d(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    meta = AttentionMetadata(
        num_actual_tokens=total, num_reqs=reqs, max_query_len=inp.max_query_len,
        max_seq_len=inp.max_seq_len, query_start_loc=d(inp.query_start_loc),
        seq_lens=d(inp.seq_lens), block_tables=d(inp.block_tables),
        slot_mapping=d(inp.slot_mapping),
        query_start_loc_cpu=torch.from_numpy(inp.query_start_loc),
        seq_lens_cpu=torch.from_numpy(inp.seq_lens), block_size=bs)
    inter = None
    if worker.parallel.pp_size > 1 and not worker.parallel.pp.is_first:
        h = torch.zeros(total, int(mc.hf_config.hidden_size), dtype=worker.dtype,
                        device=dev)
        inter = (h, h.clone())
    hidden = worker.model(d(inp.input_ids), d(inp.positions), meta, False, inter) \
        if inter is not None else worker.model(d(inp.input_ids), d(inp.positions), meta)
    logits = None
    if worker.parallel.pp_size == 1 or worker.parallel.pp.is_last:
        logits = worker.model.compute_logits(hidden[d(inp.query_start_loc[1:] - 1).long()])
        _sample_every_row(logits, _RANDOM, mc.vocab_size)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del hidden, logits, caches
    worker.model.bind_kv_caches([None] * (end - start))  # type: ignore[list-item]
    torch.cuda.empty_cache()
    return int(peak)


@torch.inference_mode()
def warm_logits_and_sampling(worker: Worker) -> None:
    """Run, once at start-up, what a step does outside its CUDA graph at every batch size
    it can have: the lm_head GEMM at each row count 1 .. ``max_num_seqs``, then greedy and
    random sampling at ``max_num_seqs`` rows.

    * cuBLAS picks its kernel by row count, and each kernel's first launch is slow,
      most likely because CUDA loads modules lazily (the default).  Without this warm-up
      a first W1 run on an H200 had 25 step launches of 20-35 ms as its batch grew, one
      every ~8 rows, and a second run had none.  The graphs' GEMMs were first launched
      at capture.
    * The caching allocator then holds blocks for the largest logits and sampling
      tensors, which smaller steps split, so no step waits on a cudaMalloc.

    Run after the CUDA graphs are captured (their memory pool is separate); the memory
    plan's profile already counted these tensors.
    """
    mc, sc = worker.config.model_config, worker.config.scheduler_config
    dev = worker.device
    rows = sc.max_num_seqs
    hidden = torch.zeros(rows, mc.hf_config.hidden_size, dtype=worker.dtype, device=dev)
    for m in range(1, rows):
        worker.model.compute_logits(hidden[:m])
    logits = worker.model.compute_logits(hidden)
    for params in (SamplingParams(temperature=0.0, max_tokens=1), _RANDOM):
        _sample_every_row(logits, params, mc.vocab_size)
    torch.cuda.synchronize(dev)
    del hidden, logits
