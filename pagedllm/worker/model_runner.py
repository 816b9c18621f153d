"""The model runner: apply the scheduler's diffs -> build inputs -> forward -> sample.

It owns every device tensor (model, KV caches) and the per-request state the scheduler
sends only once (prompt, sampling parameters, seeded generator).  The step reads top to
bottom; the only device->host sync is the one named ``_to_host`` call per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import (
    ForkRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, compute_prompt_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.block_ops import BlockOps
from pagedllm.worker.input_batch import InputBatch, StepInputs


@dataclass
class CachedRequestState:
    """What the runner remembers about a request (also across recompute preemption,
    so a seeded request's generator keeps its state)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None = None
    prompt_logprobs_done: int = field(default=0)  # prompt positions already reported


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        mc, sc = config.model_config, config.scheduler_config
        self.vocab_size = mc.vocab_size
        self.block_size = config.cache_config.block_size
        self.batch = InputBatch(sc.max_num_seqs, mc.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # Swap and copy-on-write moves on the KV tensors (set by the worker).
        self.block_ops: BlockOps | None = None

    @staticmethod
    def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed)
        return gen

    def _fork(self, f: ForkRequestData) -> None:
        """A new sequence continuing ``f.parent_req_id``: same tokens and blocks so far,
        its own parameters (own seed -> own generator) when they differ."""
        p = self.requests[f.parent_req_id]
        params = f.sampling_params or p.params
        # Without new parameters the child is a beam: greedy, no generator needed.
        gen = self._generator(params, self.device) if f.sampling_params else None
        self.requests[f.child_req_id] = CachedRequestState(
            f.child_req_id, p.prompt_token_ids, list(p.output_token_ids), params,
            p.eos_token_id, gen)
        self.batch.fork(f.parent_req_id, f.child_req_id)

    # -- 1. apply the scheduler's diffs ------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> dict[str, int]:
        for f in sched.forks:  # before removals: a parent may leave in this same step
            self._fork(f)
        for rid in sched.finished_req_ids:
            self.batch.remove(rid)
            if rid not in sched.preempted_req_ids:
                self.requests.pop(rid, None)
        computed: dict[str, int] = {}
        for nr in sched.new_reqs:
            st = self.requests.get(nr.req_id)
            if st is None:
                st = CachedRequestState(nr.req_id, nr.prompt_token_ids,
                                        list(nr.output_token_ids), nr.sampling_params,
                                        nr.eos_token_id,
                                        self._generator(nr.sampling_params, self.device))
                self.requests[nr.req_id] = st
            else:  # resumed after a recompute preemption: same tokens, same generator
                st.output_token_ids = list(nr.output_token_ids)
            self.batch.add(nr.req_id, st.prompt_token_ids + st.output_token_ids, nr.block_ids)
            computed[nr.req_id] = nr.num_computed_tokens
        for c in sched.cached_reqs:
            row = self.batch.row_of[c.req_id]
            self.batch.replace_blocks(row, c.replaced_block_ids)
            self.batch.append_blocks(row, c.new_block_ids)
            if c.last_token_id is not None:  # beam search picked this token, not ours
                self.batch.set_last_token(row, c.last_token_id)
                self.requests[c.req_id].output_token_ids[-1] = c.last_token_id
            computed[c.req_id] = c.num_computed_tokens
        return computed

    # -- 2. build inputs ---------------------------------------------------------------
    def _metadata(self, inp: StepInputs) -> AttentionMetadata:
        dev = self.device
        qsl_cpu = torch.from_numpy(inp.query_start_loc)
        seq_cpu = torch.from_numpy(inp.seq_lens)
        return AttentionMetadata(
            num_actual_tokens=int(inp.query_start_loc[-1]), num_reqs=len(inp.seq_lens),
            max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len,
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_cpu.to(dev, non_blocking=True),
            block_tables=torch.from_numpy(inp.block_tables).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(inp.slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, block_size=self.block_size)

    # -- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        computed = self._update_states(sched)
        if self.block_ops is not None:  # swap and copy-on-write, before any KV write
            self.block_ops.apply(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        order = list(sched.num_scheduled_tokens)
        rows = np.fromiter((self.batch.row_of[r] for r in order), np.int64, len(order))
        num_new = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(order))
        num_computed = np.fromiter((computed[r] for r in order), np.int64, len(order))
        inp = self.batch.prepare(rows, num_computed, num_new)
        meta = self._metadata(inp)

        hidden = self.model(torch.from_numpy(inp.input_ids).to(self.device),
                            torch.from_numpy(inp.positions).to(self.device), meta)

        # Sample only requests whose known tokens are all computed after this step.
        sampling = (num_computed + num_new) >= self.batch.num_tokens[rows]
        sample_idx = np.nonzero(sampling)[0]
        states = [self.requests[order[i]] for i in sample_idx]
        out = ModelRunnerOutput(req_ids=order, sampled_token_ids=[[] for _ in order])
        if len(sample_idx):
            logits_idx = torch.from_numpy(inp.query_start_loc[1:][sample_idx] - 1)
            logits = self.model.compute_logits(hidden[logits_idx.to(self.device)])
            smeta = SamplingMetadata.build(states, self.device, self.vocab_size)
            sampled = self.sampler(logits, smeta)
            tokens, lp = self._to_host(sampled)
            self.batch.append_token(rows[sample_idx], np.asarray(tokens, dtype=np.int64))
            for j, (i, st) in enumerate(zip(sample_idx, states)):
                st.output_token_ids.append(tokens[j])
                out.sampled_token_ids[i] = [tokens[j]]
                if lp is not None and st.params.logprobs is not None:
                    k = st.params.logprobs + 1
                    out.logprobs[st.req_id] = (lp[0][j][:k], lp[1][j][:k], lp[2][j])
        self._prompt_logprobs(sched, order, inp, hidden, num_computed, out)
        return out

    @staticmethod
    def _to_host(sampled) -> tuple[list[int], tuple[list, list, list] | None]:
        """The step's one device->host transfer: sampled ids (+ logprobs if asked)."""
        tokens = sampled.sampled_token_ids.tolist()
        lp = sampled.logprobs
        if lp is None:
            return tokens, None
        return tokens, (lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist())

    def _prompt_logprobs(self, sched: SchedulerOutput, order: Sequence[str], inp: StepInputs,
                         hidden: torch.Tensor, num_computed: np.ndarray,
                         out: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given its prefix, for requests that asked."""
        for i, rid in enumerate(order):
            st = self.requests[rid]
            k = st.params.prompt_logprobs
            if k is None:
                continue
            n_prompt = len(st.prompt_token_ids)
            start = int(num_computed[i])
            end = min(start + int(sched.num_scheduled_tokens[rid]), n_prompt - 1)
            if end <= start:
                continue
            # Position p predicts prompt token p + 1.
            q0 = int(inp.query_start_loc[i])
            h = hidden[q0:q0 + (end - start)]
            logits = self.model.compute_logits(h)
            targets = torch.tensor(st.prompt_token_ids[start + 1:end + 1], device=self.device)
            t = compute_prompt_logprobs(logits, targets, k)
            out.prompt_logprobs[rid] = LogprobsLists(
                t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())
