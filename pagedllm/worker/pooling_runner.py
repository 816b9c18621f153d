"""The pooling model runner: whole prompts in, one vector (or score) per request out.

```
 SchedulerOutput.new_reqs (whole prompts; core/pooling_scheduler.py)
   -> flattened ids [T], query_start_loc [R + 1]      (host, numpy; one copy each)
   -> encoder:  model(ids, qsl, token_type_ids)       bidirectional, no KV cache
      decoder:  model(ids, pos, meta, last_only)      causal, through a scratch KV
   -> classify/score: model.classify -> sigmoid | softmax (per request's use_activation)
      embed/encode:   pool (cls | mean | last) -> first `dimensions` -> L2 normalise
   -> .tolist() once: ModelRunnerOutput.pooler_output {req_id: [floats]}
```

A decoder embedding model (last-token pooling, ``runner="pooling"``) still needs its
paged attention, but nothing outlives the step: the runner owns a scratch KV cache of
``cdiv(max_num_batched_tokens, block_size) + max_num_seqs + 1`` blocks and gives each
request consecutive blocks every step, so the scheduler allocates none and the memory is
bounded by the step budget, not by the number of requests.  Requests run in one step
and are forgotten after it; the step's one device->host sync is the final ``tolist``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.pooler import pool
from pagedllm.pooling_params import PoolingParams


@dataclass
class PooledStep:
    """A finished pooling step (the executor's ``StepHandle`` interface)."""

    out: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.out


class PoolingModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 kv_dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = device
        pc = config.model_config.pooler_config
        assert pc is not None, "a pooling runner needs ModelConfig.pooler_config"
        self.pooler = pc
        self.is_encoder = bool(getattr(model, "is_encoder", False))
        self.graphs = None  # no CUDA graphs: steps vary in shape and run once
        self.block_size = config.cache_config.block_size
        self.kv_caches: list[torch.Tensor] = []
        if not self.is_encoder:
            mc, sc = config.model_config, config.scheduler_config
            blocks = -(-sc.max_num_batched_tokens // self.block_size) + sc.max_num_seqs + 1
            shape = (mc.kv_entries_per_token, blocks, self.block_size, mc.num_kv_heads,
                     mc.head_dim)
            self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device)
                              for _ in range(mc.num_layers)]
            model.bind_kv_caches(self.kv_caches)  # type: ignore[operator]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> PooledStep:
        reqs = sched.new_reqs
        if not reqs:
            return PooledStep(ModelRunnerOutput([], []))
        params = [r.pooling_params or PoolingParams() for r in reqs]
        lens = np.fromiter((len(r.prompt_token_ids) for r in reqs), np.int64, len(reqs))
        qsl = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        ids = torch.from_numpy(np.concatenate(
            [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in reqs])).to(self.device)
        qsl_dev = torch.from_numpy(qsl).to(self.device)
        if self.is_encoder:
            types = None
            if any(p.token_type_ids for p in params):
                types = torch.from_numpy(np.concatenate([
                    np.asarray(p.token_type_ids or [0] * n, dtype=np.int64)
                    for p, n in zip(params, lens)])).to(self.device)
            hidden = self.model(ids, qsl_dev, types)
            last_rows = False
        else:
            last_rows = self.pooler.pooling_type == "last"
            hidden = self._decoder_forward(ids, lens, qsl, last_rows)
        if hasattr(self.model, "classify"):
            values = self._classify(hidden, qsl_dev, params)
        else:
            if last_rows:  # the model returned each request's last row already
                pooled = hidden.float()
            else:
                pooled = pool(hidden, qsl_dev, self.pooler.pooling_type)  # type: ignore
            values = self._embed(pooled, params)
        host = values.tolist() if isinstance(values, torch.Tensor) else \
            [v.tolist() for v in values]
        ids_order = [r.req_id for r in reqs]
        return PooledStep(ModelRunnerOutput(ids_order, [[] for _ in reqs],
                                            pooler_output=dict(zip(ids_order, host))))

    def _decoder_forward(self, ids: torch.Tensor, lens: np.ndarray, qsl: np.ndarray,
                         last_only: bool) -> torch.Tensor:
        """Causal forward of whole prompts through the scratch KV: request i gets the
        consecutive blocks after request i-1's (block 0 stays the null block)."""
        bs = self.block_size
        nblk = -(-lens // bs)
        first = 1 + np.concatenate([[0], np.cumsum(nblk)[:-1]])
        width = int(nblk.max())
        cols = np.arange(width)
        tables = np.where(cols[None, :] < nblk[:, None], first[:, None] + cols[None, :], 0)
        starts = np.repeat(qsl[:-1].astype(np.int64), lens)
        local = np.arange(int(qsl[-1]), dtype=np.int64) - starts
        slots = np.repeat(first * bs, lens) + local
        seq = lens.astype(np.int32)
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), num_reqs=len(lens), max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()), query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq).to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc_cpu=torch.from_numpy(qsl), seq_lens_cpu=torch.from_numpy(seq),
            block_size=bs)
        pos = torch.from_numpy(local).to(dev)
        return self.model(ids, pos, meta, last_only)

    def _embed(self, pooled: torch.Tensor, params: list[PoolingParams],
               ) -> torch.Tensor | list[torch.Tensor]:
        """Per request: its first ``dimensions`` entries, L2-normalised unless it (or
        the model's default) says not; rows with equal settings go together (one
        tensor when all agree: the usual case, one host copy)."""
        out: list[torch.Tensor | None] = [None] * len(params)
        groups: dict[tuple[int | None, bool], list[int]] = {}
        for i, p in enumerate(params):
            norm = self.pooler.normalize if p.normalize is None else p.normalize
            if p.task == "encode" and p.normalize is None:
                norm = False  # encode: the raw pooled state unless asked
            groups.setdefault((p.dimensions, norm), []).append(i)
        for (dims, norm), rows in groups.items():
            v = pooled if len(rows) == len(params) else pooled[rows]
            if dims is not None:
                v = v[:, :dims]
            if norm:
                v = F.normalize(v, dim=-1)
            if len(groups) == 1:
                return v
            for j, i in enumerate(rows):
                out[i] = v[j]
        return out  # type: ignore[return-value]

    def _classify(self, hidden: torch.Tensor, qsl: torch.Tensor,
                  params: list[PoolingParams]) -> torch.Tensor:
        """Logits, then sigmoid (one label) or softmax per request asking for it."""
        logits = self.model.classify(hidden, qsl)  # type: ignore[operator]
        act = torch.sigmoid(logits) if logits.shape[1] == 1 else logits.softmax(-1)
        use = torch.tensor([p.use_activation is not False for p in params],
                           device=logits.device)
        return torch.where(use[:, None], act, logits)
