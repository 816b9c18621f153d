"""The model runner: apply the scheduler's diffs -> build inputs -> forward -> sample.

It owns every device tensor (model, KV caches) and the per-request state the scheduler
sends only once (prompt, sampling parameters, seeded generator).  The step reads top to
bottom; the only device->host sync is the wait in ``_finish`` (one per step).  Features
sit behind one object each, called at named points of the step: ``self.spec``
(speculative decoding, ``worker/spec_decode/runner.py``; None without it),
``self.grammar`` (structured outputs and other token constraints,
``worker/structured_output/runner.py``) and ``self.lora`` (``worker/lora/manager.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.block_ops import BlockOps
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.encoder_cache import EncoderCache
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.worker.lora.manager import make_lora_manager
from pagedllm.worker.mrope_positions import MRopePositions
from pagedllm.worker.pipeline import PipelineStage
from pagedllm.worker.spec_decode.runner import SpecDecodeRunner
from pagedllm.worker.structured_output.runner import GrammarRunner


class HostToDevice:
    """Copies host arrays to the device through persistent pinned buffers, so every copy
    is truly asynchronous (a pageable copy would synchronise the stream first).  On CPU
    the arrays are used in place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: dict[tuple[str, int], torch.Tensor] = {}
        # Two buffer sets used on alternate steps: with one step in flight, the set a
        # step fills is never one whose copies may still be pending.
        self.parity = 0
        self._copy_stream: Any = None  # torch.cuda.Stream for upload(side=True)

    def __call__(self, name: str, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if self.device.type == "cpu":
            return t
        staged = self.staging(name, t.shape, t.dtype)
        staged.copy_(t)
        return self.upload(staged)

    def staging(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This step's host tensor for ``name`` (pinned on CUDA; reused two steps later):
        write it in place, then :meth:`upload` it -- no copy into a staging buffer."""
        numel = int(np.prod(shape))
        key = (name, self.parity)
        buf = self.pinned.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1024), dtype=dtype,
                              pin_memory=self.device.type == "cuda")
            self.pinned[key] = buf
        return buf[:numel].view(*shape)

    def upload(self, staged: torch.Tensor, side: bool = False) -> torch.Tensor:
        """``staged`` (from :meth:`staging`) on the device, copied asynchronously.

        ``side``: on a copy stream of its own, so that the copy overlaps the kernels
        already queued (a forward launched before the host filled ``staged``) instead of
        waiting behind them; work queued after this call waits for it."""
        if self.device.type == "cpu":
            return staged
        if not side:
            return staged.to(self.device, non_blocking=True)
        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            out = staged.to(self.device, non_blocking=True)
        main.wait_stream(self._copy_stream)
        out.record_stream(main)  # allocated on the copy stream, used on the main one
        return out


def _to_pinned_host(lp: LogprobsTensors) -> LogprobsTensors:
    """Start copying sampled logprobs into fresh pinned host tensors (non-blocking: the
    step's event, recorded after, marks them complete).  Reading them with ``tolist()``
    on the device would wait for every step queued since, not just this one."""
    def host(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    return LogprobsTensors(host(lp.token_ids), host(lp.logprobs), host(lp.ranks))


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
    # Structured outputs: the request's grammar matcher (worker/structured_output/matcher.py).
    grammar: Any = None
    lora_request: Any = None  # its LoRA adapter (lora/), None: the base model


@dataclass
class StepHandle:
    """A launched step.  ``result()`` waits for its sampled tokens (the step's one
    device->host transfer), records them in the runner's state and returns the output."""

    runner: ModelRunner
    out: ModelRunnerOutput
    states: list[CachedRequestState] = field(default_factory=list)
    sample_idx: np.ndarray | None = None
    tokens_host: torch.Tensor | None = None
    logprobs: Any = None
    event: Any = None
    done: bool = False
    # Speculative decoding: tokens_host is [R, spec_width] (PLACEHOLDER-padded); drafts
    # per request to propose once the tokens are in (the scheduler's policy).
    spec_width: int = 0
    # EAGLE: the step's hidden states for the proposer (worker/spec_decode/eagle_proposer.py).
    target_states: Any = None
    num_spec_proposals: int = 0

    def result(self) -> ModelRunnerOutput:
        if not self.done:
            self.runner._finish(self)
            self.done = True
        return self.out


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 parallel: ParallelState = SINGLE_RANK) -> None:
        self.config = config
        self.model = model
        self.device = device
        # Pipeline parallelism: this rank's stage of the forward (worker/pipeline.py).
        self.stage: PipelineStage | None = None
        if parallel.pp_size > 1:
            self.stage = PipelineStage(parallel, int(config.model_config.hf_config
                                                     .hidden_size),
                                       next(model.parameters()).dtype, device)
        mc, sc = config.model_config, config.scheduler_config
        self.vocab_size = mc.vocab_size
        self.block_size = config.cache_config.block_size
        groups = config.cache_config.kv_cache_groups
        self.num_kv_groups = len(groups.groups) if groups is not None else 1
        self.batch = InputBatch(sc.max_num_seqs, mc.max_model_len, self.block_size,
                                self.num_kv_groups)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.h2d = HostToDevice(device)
        self.graphs: CudaGraphRunner | None = None
        # calculate_kv_scales (layers/kv_scales.py): the first step with real tokens runs
        # eagerly and sets every layer's fp8 KV scales; CUDA graphs are captured after it
        # (``_graph_margin``: the capture deferred until then), so they bake in the final
        # scales, not 1.0.
        self._calc_kv_scales = config.cache_config.calculate_kv_scales
        self._graph_margin: int | None = None
        # Async scheduling: tokens sampled by the last launched step that the host has
        # not read yet (req id -> row of ``_last_sampled``); the next step takes them
        # from the device directly.
        self._pending: dict[str, int] = {}
        self._pending_owner: StepHandle | None = None
        self._last_sampled: torch.Tensor | None = None
        self._tokens_host = [torch.empty(0, dtype=torch.int64) for _ in range(2)]
        # Live requests that asked for prompt logprobs (so most steps skip that scan).
        self._prompt_lp_ids: set[str] = set()
        # Swap and copy-on-write moves on the KV tensors (set by the worker).
        self.block_ops: BlockOps | None = None
        # The model's last layer runs past attention only on the rows logits come from
        # (models/llama.py); speculative decoding turns it off below.
        self.last_only = True
        # Structured outputs and the other token constraints: matchers, the step's
        # bitmask (worker/structured_output/runner.py).
        self.grammar = GrammarRunner(self.vocab_size, device, self.h2d, self._wait_in_flight)
        # Multi-LoRA (worker/lora/manager.py): adapter slots on the linear layers.
        self.lora = make_lora_manager(config, model, device)
        # Images (worker/encoder_cache.py): encoder outputs and the steps' input
        # embeddings; None for a text-only model.
        self.mm = EncoderCache(model, device) \
            if getattr(mc, "multimodal_config", None) is not None else None
        # M-RoPE (worker/mrope_positions.py): [3, T] positions for models declaring it.
        self.mrope = MRopePositions(model) if getattr(model, "uses_mrope", False) else None
        # Speculative decoding (worker/spec_decode/runner.py): verify drafts, propose more.
        spec = sc.speculative_config
        self.spec = SpecDecodeRunner(spec, mc.max_model_len, self.batch, self.h2d, device,
                                     self.vocab_size, self.grammar) if spec is not None else None
        if self.spec is not None:
            # A verify step needs logits at every draft position: chunk graphs captured
            # for every row let verify steps replay a graph instead of running eager.
            self.last_only = False

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
            p.eos_token_id, gen,
            p.grammar.fork(p.output_token_ids) if p.grammar is not None else None,
            p.lora_request)
        self.batch.fork(f.parent_req_id, f.child_req_id)
        self.grammar.fork(f.parent_req_id, f.child_req_id)
        if params.prompt_logprobs is not None:
            self._prompt_lp_ids.add(f.child_req_id)

    def capture_cuda_graphs(self, memory_margin: int) -> None:
        """Capture decode and chunk graphs (CUDA only, unless enforce_eager);
        ``memory_margin``: what the memory plan set aside for them.  Deferred to the
        second step while the KV scales wait for the first (``calculate_kv_scales``)."""
        if self._calc_kv_scales:
            self._graph_margin = memory_margin
            return
        mc = self.config.model_config
        if self.lora is not None:  # graphs always contain the LoRA ops (-1 rows: no-op)
            self.lora.mapping.active = True
        # A model may cap its chunk graphs (``max_chunk_graph_tokens``: MLA's chunk steps
        # replay the absorbed form, whose cost grows with the chunk's square).
        max_capture = min(self.config.device_config.max_cudagraph_capture_size,
                          getattr(self.model, "max_chunk_graph_tokens", None) or 1 << 30)
        self.graphs = CudaGraphRunner(
            self.model, self.device, self.config.scheduler_config.max_num_seqs,
            self.batch.block_table.shape[1], self.block_size, mc.max_model_len,
            self.config.scheduler_config.max_num_batched_tokens, max_capture, memory_margin,
            last_only=self.last_only, num_kv_groups=self.num_kv_groups,
            position_rows=3 if self.mrope is not None else 1,
            chunk_graphs=getattr(self.model, "cuda_graph_steps", "all") == "all")
        self.graphs.capture()

    # -- 1. apply the scheduler's diffs ------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> dict[str, int]:
        for f in sched.forks:  # before removals: a parent may leave in this same step
            self._fork(f)
        for rid in sched.finished_req_ids:
            self.batch.remove(rid)
            if self.spec is not None:
                self.spec.forget(rid)
            if rid not in sched.preempted_req_ids:
                self.requests.pop(rid, None)
                self._prompt_lp_ids.discard(rid)
                self.grammar.remove(rid)
        computed: dict[str, int] = {}
        for nr in sched.new_reqs:
            st = self.requests.get(nr.req_id)
            if st is None:
                st = CachedRequestState(nr.req_id, nr.prompt_token_ids,
                                        list(nr.output_token_ids), nr.sampling_params,
                                        nr.eos_token_id,
                                        self._generator(nr.sampling_params, self.device),
                                        self.grammar.new_state(nr.sampling_params,
                                                               nr.eos_token_id),
                                        nr.lora_request)
                self.requests[nr.req_id] = st
                if nr.sampling_params.prompt_logprobs is not None:
                    self._prompt_lp_ids.add(nr.req_id)
                self.grammar.add(st)
            else:  # resumed after a recompute preemption: same tokens, same generator
                st.output_token_ids = list(nr.output_token_ids)
                if st.grammar is not None:
                    st.grammar.sync(st.output_token_ids)
            self.batch.add(nr.req_id, st.prompt_token_ids + st.output_token_ids, nr.block_ids,
                           nr.group_block_ids)
            computed[nr.req_id] = nr.num_computed_tokens
        for c in sched.cached_reqs:
            row = self.batch.row_of[c.req_id]
            self.batch.replace_blocks(row, c.replaced_block_ids)
            if c.replaced_block_ids and self.spec is not None:  # the copy has no draft KV
                self.spec.forget(c.req_id)
            self.batch.append_blocks(row, c.new_block_ids)
            if c.new_group_block_ids is not None:  # hybrid KV cache groups
                self.batch.append_group_blocks(row, c.new_group_block_ids)
                if c.replaced_group_block_ids:
                    self.batch.replace_group_blocks(row, c.replaced_group_block_ids)
            if c.last_token_id is not None:  # beam search picked this token, not ours
                self.batch.set_last_token(row, c.last_token_id)
                self.requests[c.req_id].output_token_ids[-1] = c.last_token_id
            computed[c.req_id] = c.num_computed_tokens
        return computed

    # -- 2. build inputs ---------------------------------------------------------------
    def _metadata(self, inp: StepInputs) -> AttentionMetadata:
        h2d = self.h2d
        meta = AttentionMetadata(
            num_actual_tokens=int(inp.query_start_loc[-1]), num_reqs=len(inp.seq_lens),
            max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len,
            query_start_loc=h2d("qsl", inp.query_start_loc),
            seq_lens=h2d("seq_lens", inp.seq_lens),
            block_tables=h2d("block_tables", inp.block_tables),
            slot_mapping=h2d("slots", inp.slot_mapping),
            query_start_loc_cpu=torch.from_numpy(inp.query_start_loc),
            seq_lens_cpu=torch.from_numpy(inp.seq_lens), block_size=self.block_size)
        if inp.group_block_tables is not None:  # hybrid KV cache groups 1..
            assert inp.group_slot_mapping is not None
            tables = h2d("group_block_tables", inp.group_block_tables)
            slots = h2d("group_slots", inp.group_slot_mapping)
            meta.with_groups(list(tables.unbind(0)), list(slots.unbind(0)))
        return meta

    def _forward(self, inp: StepInputs, fix: Callable[[torch.Tensor], None] | None,
                 last_only: bool,
                 embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 query_limits: np.ndarray | None = None,
                 ) -> torch.Tensor | None:
        """Hidden states of every scheduled token, or with ``last_only`` of each
        request's last one (row i: request i): a CUDA-graph replay when the step fits a
        captured shape (``worker/cuda_graphs.py``), an eager forward otherwise; None on
        a pipeline stage before the last (``worker/pipeline.py``).  ``fix``
        patches the device input ids (tokens still in flight) before the model reads them;
        ``embed`` (a step with images, ``worker/encoder_cache.py``) turns them into the
        model's ``inputs_embeds``, in an eager forward, with ``query_limits`` for a model
        whose image tokens see their whole run (``AttentionMetadata.query_limits``)."""
        num_reqs = len(inp.seq_lens)
        if self._calc_kv_scales:  # this step, eagerly, sets the fp8 KV scales
            from pagedllm.layers import kv_scales

            kv_scales.arm(self.model)
            self._calc_kv_scales = False
        elif self._graph_margin is not None:
            margin, self._graph_margin = self._graph_margin, None
            self.capture_cuda_graphs(margin)
        # KV blocks this step loads from the host tier: each layer's attention waits
        # for its own (worker/block_ops.py), which a graph replay cannot.
        loads = self.block_ops.step_loads if self.block_ops is not None else None
        if self.graphs is not None and embed is None and loads is None:
            shape = self.graphs.padded_shape(len(inp.input_ids), num_reqs,
                                             inp.max_query_len)
            # A chunk graph returns what it was captured for: every row, or the last ones.
            if shape is not None and (shape.decode or last_only == self.graphs.last_only):
                return self.graphs.run(inp, shape, fix, self.h2d.parity)
        meta = self._metadata(inp)
        if loads is not None:
            meta.with_kv_ready(loads.wait)
        ids = self.h2d("ids", inp.input_ids)
        if fix is not None:
            fix(ids)
        if embed is not None:
            if query_limits is not None:
                meta.with_query_limits(self.h2d("query_limits", query_limits))
            hidden = self.model(ids, self.h2d("pos", inp.positions), meta, last_only,
                                inputs_embeds=embed(ids))
        elif self.stage is not None:
            hidden = self.stage.forward(self.model, ids, self.h2d("pos", inp.positions),
                                        meta, last_only)
        else:
            hidden = self.model(ids, self.h2d("pos", inp.positions), meta, last_only)
        if loads is not None:
            self.block_ops.check_waits(loads)  # type: ignore[union-attr]
        return hidden

    def _pending_fix(self, order: list[str], inp: StepInputs,
                     ) -> tuple[np.ndarray, Callable[[torch.Tensor], None] | None]:
        """Which scheduled requests decode a token the host has not seen yet, and the
        device-side patch that puts those tokens into the input ids."""
        if not self._pending:
            return np.zeros(len(order), dtype=np.int64), None
        pend = np.fromiter((r in self._pending for r in order), np.int64, len(order))
        idx = np.nonzero(pend)[0]
        if len(idx) == 0:
            return pend, None
        # Such a request is a single-token decode: its token is the first of its slice.
        dst = self.h2d("pend_dst", inp.query_start_loc[idx].astype(np.int64))
        src = self.h2d("pend_src", np.fromiter((self._pending[order[i]] for i in idx),
                                               np.int64, len(idx)))
        prev = self._last_sampled
        assert prev is not None

        def fix(ids: torch.Tensor) -> None:
            ids.index_copy_(0, dst, prev.index_select(0, src))

        return pend, fix

    # -- the step ----------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Launch the step; the sampled tokens are read back by ``StepHandle.result``."""
        self.h2d.parity ^= 1
        computed = self._update_states(sched)
        if self.mm is not None:  # image requests in and out; this step's encoder runs
            self.mm.update(sched)
        if self.mrope is not None:
            self.mrope.update(sched)
        drafts = sched.scheduled_spec_decode_tokens
        if drafts:  # the drafts are the input tokens after each row's last one
            self.spec.write_drafts(drafts)  # type: ignore[union-attr]
        if self.block_ops is not None:  # swap and copy-on-write, before any KV write
            self.block_ops.apply(sched)
        if sched.total_num_scheduled_tokens == 0:
            return StepHandle(self, ModelRunnerOutput([], []))
        order = list(sched.num_scheduled_tokens)
        rows = np.fromiter((self.batch.row_of[r] for r in order), np.int64, len(order))
        num_new = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(order))
        num_computed = np.fromiter((computed[r] for r in order), np.int64, len(order))
        inp = self.batch.prepare(rows, num_computed, num_new)
        if self.mrope is not None:  # [3, T]: image requests' rows (layers/mrope.py)
            inp.positions = self.mrope.positions(order, num_computed, num_new,
                                                 inp.query_start_loc, inp.positions)
        # Prompt logprobs read the hidden state of every prompt token.
        last_only = self.last_only and not (self._prompt_lp_ids and inp.max_query_len > 1) \
            and not drafts
        lora_failed: dict[int, str] = {}
        if self.lora is not None:  # the last layer's LoRA map follows the pruning
            loras = [self.requests[r].lora_request for r in order]
            lora_failed = self.lora.prepare_step(
                loras, num_new, self.h2d, pruned=last_only and inp.max_query_len > 1)
        pending, fix = self._pending_fix(order, inp)
        embed = self.mm.embedder(order, num_computed, num_new, inp.query_start_loc) \
            if self.mm is not None else None
        limits = self.mm.query_limits(order, num_computed, num_new, inp.query_start_loc) \
            if embed is not None and self.mm.whole_runs else None  # type: ignore[union-attr]
        hidden = self._forward(inp, fix, last_only, embed, limits)
        if self.mm is not None:
            self.mm.release(sched.free_encoder_inputs)

        # Sample only requests whose known tokens (incl. one still in flight) are all
        # computed after this step.
        sampling = (num_computed + num_new) >= self.batch.num_tokens[rows] + pending
        sample_idx = np.nonzero(sampling)[0]
        states = [self.requests[order[i]] for i in sample_idx]
        handle = StepHandle(self, ModelRunnerOutput(
            req_ids=order, sampled_token_ids=[[] for _ in order]), states, sample_idx,
            num_spec_proposals=sched.num_spec_proposals)
        if lora_failed:  # their rows ran without the adapter: the scheduler fails them
            handle.out.failed = {
                rid: f"adapter {r.lora_name!r}: {lora_failed[r.lora_int_id]}"
                for rid, r in zip(order, loras)
                if r is not None and r.lora_int_id in lora_failed}
        if self.spec is not None and hidden is not None:  # EAGLE: the head reads them
            handle.target_states = self.spec.target_states(
                self.model, inp, order, rows, num_computed, num_new, hidden, sampling)
        if len(sample_idx):
            last_row = inp.query_start_loc[1:][sample_idx] - 1  # each request's last row
            in_flight = pending[sample_idx]
            k = None  # drafts to verify per sampled request
            if drafts:
                k, last_row = self.spec.plan_verify(  # type: ignore[union-attr]
                    order, drafts, sample_idx, states, last_row)
            if hidden is None:  # a pipeline stage before the last: see record_sampled_tokens
                return handle
            logprobs = None
            if k is not None:  # verify drafts (worker/spec_decode/)
                ids = self.spec.verify(  # type: ignore[union-attr]
                    self.model, hidden, last_row, k, states, drafts, in_flight)
                handle.spec_width = ids.shape[1]
            else:
                ids, logprobs = self._sample(hidden, sample_idx if last_only else last_row,
                                             states, in_flight)
            self._start_read_back(handle, ids, logprobs)
        else:
            self._pending, self._pending_owner = {}, None
        if self._prompt_lp_ids and hidden is not None:  # usually none: skip the scan
            self._prompt_logprobs(sched, order, inp, hidden, num_computed, handle.out)
        return handle

    def _sample(self, hidden: torch.Tensor, rows: np.ndarray,
                states: list[CachedRequestState], in_flight: np.ndarray,
                ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """One token per sampled request (``states``), from the logits at ``rows`` of
        ``hidden``; ``in_flight``: whether its last token is still on the device."""
        logits = self.model.compute_logits(hidden[self.h2d("logits_idx", rows)])
        # A request's in-flight token counts towards min_tokens already.
        smeta = SamplingMetadata.build(states, self.device, self.vocab_size,
                                       num_in_flight=in_flight)
        if self.grammar.active:  # grammars, allowed/bad tokens, logits processors
            smeta = self.grammar.constrain(smeta, states, in_flight)
        sampled = self.sampler(logits, smeta)
        return sampled.sampled_token_ids, sampled.logprobs

    def _start_read_back(self, handle: StepHandle, ids: torch.Tensor,
                         logprobs: LogprobsTensors | None) -> None:
        """Keep the step's sampled tokens on the device for the next step (its input
        ids: ``_pending_fix``) and start their copy to the host (read by ``_finish``)."""
        self._last_sampled = ids
        self._pending = {st.req_id: j for j, st in enumerate(handle.states)}
        self._pending_owner = handle
        handle.logprobs = logprobs
        if self.device.type == "cuda":
            if logprobs is not None:  # to host with the tokens, not after
                handle.logprobs = _to_pinned_host(logprobs)
            buf = self._tokens_host[self.h2d.parity]
            if buf.numel() < ids.numel():
                buf = torch.empty(max(ids.numel(), 1024), dtype=torch.int64,
                                  pin_memory=True)
                self._tokens_host[self.h2d.parity] = buf
            handle.tokens_host = buf[:ids.numel()].view(ids.shape)
            handle.tokens_host.copy_(ids, non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record()
        else:
            handle.tokens_host = ids

    def _finish(self, handle: StepHandle) -> None:
        """The step's one device->host wait: record its sampled tokens (the requests'
        rows may have moved since, or gone: finished or preempted)."""
        if handle.tokens_host is None:
            return
        if handle.event is not None:
            handle.event.synchronize()
        tokens: list[Any] = handle.tokens_host.tolist()
        if handle.spec_width:  # a verify step: several tokens per request
            self.spec.record_verified(handle, tokens)  # type: ignore[union-attr]
        else:
            self._record_tokens(handle, tokens)
        if self._pending_owner is handle:  # no later step launched: nothing in flight
            self._pending, self._pending_owner = {}, None
        if self.spec is not None:  # drafts for the next step
            self.spec.propose_next(handle)

    def _record_tokens(self, handle: StepHandle, tokens: list[int]) -> None:
        """One sampled token per request (and its logprobs) into the runner's state and
        the step's output."""
        lp = handle.logprobs
        lp_lists = (lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()) \
            if lp is not None else None
        out = handle.out
        rows, toks = [], []
        assert handle.sample_idx is not None
        for j, (i, st) in enumerate(zip(handle.sample_idx, handle.states)):
            st.output_token_ids.append(tokens[j])
            out.sampled_token_ids[i] = [tokens[j]]
            row = self.batch.row_of.get(st.req_id)
            if row is not None:
                rows.append(row)
                toks.append(tokens[j])
            if lp_lists is not None and st.params.logprobs is not None:
                k = st.params.logprobs + 1
                out.logprobs[st.req_id] = (lp_lists[0][j][:k], lp_lists[1][j][:k],
                                           lp_lists[2][j])
        self.grammar.advance(handle.states, tokens)  # every matcher in one xgrammar call
        if rows:
            self.batch.append_token(np.asarray(rows, dtype=np.int64),
                                    np.asarray(toks, dtype=np.int64))

    def _wait_in_flight(self) -> None:
        """Wait for the tokens of the step still in flight, if any (grammar masks need
        every token)."""
        if self._pending_owner is not None:
            self._pending_owner.result()

    def record_sampled_tokens(self, req_ids: list[str],
                              sampled_token_ids: list[list[int]]) -> None:
        """A pipeline stage before the last learns the tokens sampled by the last one
        with a later step (``worker/pipeline.py``): record them as ``_finish`` does.
        Requests gone meanwhile (finished, aborted) are skipped."""
        rows, toks = [], []
        for rid, tokens in zip(req_ids, sampled_token_ids):
            st = self.requests.get(rid)
            if st is None or not tokens:
                continue
            st.output_token_ids.extend(tokens)
            row = self.batch.row_of.get(rid)
            if row is None:
                continue
            if len(tokens) == 1:
                rows.append(row)
                toks.append(tokens[0])
            else:  # several (speculative decoding): one at a time
                for t in tokens:
                    self.batch.append_token(np.asarray([row]), np.asarray([t]))
        if rows:
            self.batch.append_token(np.asarray(rows, dtype=np.int64),
                                    np.asarray(toks, dtype=np.int64))

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
