"""The worker: pick the device, load the model, size and allocate the KV cache.

KV sizing (in the cache's element type: ``kv_cache_dtype="fp8"`` is 1 byte per element,
twice the blocks of a bf16 cache): ``kv_cache_memory_bytes`` when given; otherwise on
CPU a default of ``DEFAULT_CPU_KV_BYTES`` (capped at what ``max_num_seqs`` full-length
requests could use), and on GPU ``gpu_memory_utilization`` of the device minus the
weights and the profiled activation peak.  The plan is logged once at start-up.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kv_cache_dtype import check_backend, kv_torch_dtype
from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.prefill_pacing import fill_sizes
from pagedllm.distributed.parallel_state import (
    SINGLE_RANK,
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    layer_range,
    parallel_context,
)
from pagedllm.layers.linear import head_partition
from pagedllm.models.loader import load_model, weight_bytes
from pagedllm.spec_decode.policy import StepCostCurve
from pagedllm.worker.block_ops import BlockOps, allocate_swap_space
from pagedllm.worker.cuda_graphs import (
    GRAPH_MEMORY_MARGIN,
    chunk_capture_sizes,
    graph_memory_margin,
)
from pagedllm.worker.disk_pool import DiskPool
from pagedllm.worker.kv_groups import bind_kv_cache_groups
from pagedllm.worker.model_runner import ModelRunner, StepHandle
from pagedllm.worker.profile import profile_run, profile_tokens, warm_logits_and_sampling
from pagedllm.worker.startup_memory import check_cpu_kv_fits
from pagedllm.worker.step_cost import curve_from_graphs, measure_step_cost

logger = logging.getLogger("pagedllm")

DEFAULT_CPU_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def make_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA when available; on the CPU the torch reference with C decode steps
    (``attention/cpu_backend.py``)."""
    if device.type == "cuda":
        try:
            from pagedllm.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        except ImportError:  # pragma: no cover - triton missing on a GPU box
            logger.warning("triton not available; using the torch reference attention")
    if device.type == "cpu":
        from pagedllm.attention.cpu_backend import CpuBackend

        return CpuBackend()
    from pagedllm.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()


def device_index(pc: ParallelConfig, local_rank: int) -> int:
    """The host device of an engine's rank ``local_rank``: data-parallel engine ``d``'s
    ranks take the devices after engines ``0..d-1``'s (each engine its own GPUs, as in
    vLLM; the DP client gives every engine its ``data_parallel_rank``)."""
    if pc.data_parallel_size > 1:
        return pc.data_parallel_rank * pc.world_size + local_rank
    return local_rank


class Worker:
    """One rank.  ``rank`` in its engine's world (``distributed/parallel_state.py``),
    ``local_rank`` its device index on this host, ``distributed_init_method`` the
    rendezvous (``tcp://host:port``) when the world has more than one rank.  It never
    knows which executor started it (``executor/``)."""

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank, self.local_rank = rank, local_rank
        self.init_method = distributed_init_method
        pc = config.parallel_config
        self.device = torch.device(config.device_config.device)
        self.local_rank = local_rank = device_index(pc, local_rank)
        if pc.expert_parallel_spans_dp:
            # One world of every engine's ranks on this host (parallel_state.py).
            if not pc.data_parallel_master_port:
                raise ValueError("enable_expert_parallel with data_parallel_size > 1: "
                                 "data_parallel_master_port is not set (the DP client "
                                 "sets it for each engine: run the engines through "
                                 "pagedllm serve or AsyncLLM)")
            self.init_method = f"tcp://127.0.0.1:{pc.data_parallel_master_port}"
        if self.device.type == "cuda" and (pc.world_size > 1 or pc.data_parallel_size > 1):
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        threads = config.device_config.num_threads
        ranks_here = pc.world_size * pc.data_parallel_size
        if threads is None and ranks_here > 1:
            # Ranks (of every data-parallel engine) on one host share its cores: one
            # slice each, not all of them each.
            threads = max(1, (os.cpu_count() or 1) // ranks_here)
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.dtype = torch_dtype(config.model_config.dtype)
        self.parallel: ParallelState = SINGLE_RANK
        self.kv_dtype = kv_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.runner: ModelRunner | None = None
        self.draft_model: torch.nn.Module | None = None  # speculative_config "draft_model"
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []
        self.num_cpu_blocks = 0
        # The prefix cache's host tier (core/offload_tier.py): empty when off.
        self.offload_caches: list[torch.Tensor] = []
        self.disk_pool: DiskPool | None = None  # its disk tier (core/disk_tier.py)
        # Speculative decoding: the measured step-cost curve (worker/step_cost.py).
        self.step_cost: StepCostCurve | None = None
        # The memory plan's share for CUDA graphs (the fixed margin when the KV cache
        # size is given outright).
        self.graph_margin = GRAPH_MEMORY_MARGIN

    def init_device(self) -> None:
        """Join the engine's world (every collective of it times out after
        ``distributed_timeout_seconds``, naming this rank)."""
        pc = self.config.parallel_config
        if pc.world_size == 1 and not pc.expert_parallel_spans_dp:
            return
        if self.init_method is None:
            raise ValueError("a multi-rank worker needs distributed_init_method")
        t0 = time.perf_counter()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.parallel = init_parallel_state(
            pc.tensor_parallel_size, pc.pipeline_parallel_size, self.rank,
            self.init_method, backend, pc.distributed_timeout_seconds,
            expert_parallel=pc.enable_expert_parallel, dp_size=pc.data_parallel_size,
            dp_rank=pc.data_parallel_rank, all2all_backend=pc.all2all_backend)
        logger.info("rank %d joined the %d-rank world (%s; tp rank %d, pp rank %d, "
                    "expert-parallel rank %d of %d) in %.2f s", self.rank,
                    self.parallel.world.world_size, backend, self.parallel.tp_rank,
                    self.parallel.pp_rank, self.parallel.ep.rank_in_group,
                    self.parallel.ep.world_size, time.perf_counter() - t0)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cuda":
            from pagedllm.kernels import compile_stats

            compile_stats.install()
        self.backend = make_backend(self.device)
        check_backend(self.backend, self.config.cache_config.cache_dtype)
        with parallel_context(self.parallel):  # layers take their groups from it
            self.model = load_model(self.config.model_config, self.device, self.backend)
        # Speculative decoding with a draft model (worker/spec_decode/draft_model.py), an
        # EAGLE head (worker/spec_decode/eagle.py) or the target's MTP layer (mtp.py).
        draft_cfg = self._draft_config
        spec = self.config.scheduler_config.speculative_config
        if draft_cfg is not None and spec.method in ("eagle", "eagle3"):
            from pagedllm.worker.spec_decode.eagle import enable_aux_states, load_eagle_head

            self.draft_model = load_eagle_head(draft_cfg, spec.method, self.model,
                                               self.device, self.backend)
            if spec.method == "eagle3":  # before the memory plan: it counts the buffer
                sc = self.config.scheduler_config
                enable_aux_states(self.model, draft_cfg.hf_config,
                                  max(sc.max_num_batched_tokens, sc.max_num_seqs))
        elif draft_cfg is not None and spec.method == "mtp":
            from pagedllm.worker.spec_decode.mtp import load_mtp

            self.draft_model = load_mtp(draft_cfg, self.model, self.device)
        else:
            self.draft_model = None if draft_cfg is None else load_model(
                draft_cfg, self.device, self.backend)
        if self.device.type == "cuda":
            # Weights must be final before any kernel runs: PDL kernels read weights
            # before waiting for their predecessor (kernels/pdl.py).
            torch.cuda.synchronize(self.device)
        mc = self.config.model_config
        quant = getattr(self.model, "quant_description", None) or "unquantised"
        stored = weight_bytes(self.model)
        saved = ""
        if mc.quantization is not None:
            full = weight_bytes(self.model, as_dtype_bytes=self.dtype.itemsize)
            saved = f", {(full - stored) / (1 << 20):.1f} MiB less than {mc.dtype}"
        logger.info("loaded %s (%s, %s, weights %s: %.1f MiB%s) in %.1f s",
                    mc.served_model_name, mc.dtype, self.device, quant,
                    stored / (1 << 20), saved, time.perf_counter() - t0)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores (``head_partition``: its share, or one replica)."""
        mc = self.config.model_config
        heads = int(mc.hf_config.num_attention_heads)
        return head_partition(heads, mc.num_kv_heads, self.parallel.tp_size)[
            self.parallel.tp_rank][3]

    @property
    def local_layers(self) -> tuple[int, int]:
        """``[start, end)`` of the decoder layers this rank's pipeline stage runs."""
        return layer_range(self.config.model_config.num_layers, self.parallel.pp_size,
                           self.parallel.pp_rank)

    @property
    def num_kv_tensors(self) -> int:
        """KV tensors this rank allocates: one per layer, or with hybrid KV cache groups
        one per layer of a group (``core/kv_cache_groups.py``: the groups share them)."""
        groups = self.config.cache_config.kv_cache_groups
        if groups is not None and groups.hybrid:
            return groups.num_tensors
        start, end = self.local_layers
        return end - start

    @property
    def _draft_config(self) -> object | None:
        """The draft's ModelConfig (speculative_config method "draft_model", "eagle",
        "eagle3" or "mtp")."""
        spec = self.config.scheduler_config.speculative_config
        return None if spec is None else spec.draft_model_config

    def kv_bytes_per_token(self) -> int:
        """This rank's KV bytes per token of a block: its KV tensors (its layers, or a
        group's share with hybrid groups) and its KV heads, in the cache's element type
        (``CacheConfig.cache_dtype``: fp8 is one byte); with a draft model, its KV too (it
        lives in the same blocks, worker/spec_decode/draft_model.py; a draft refuses sliding-window
        targets, so never with hybrid groups)."""
        mc = self.config.model_config
        elem = 1 if self.config.cache_config.cache_dtype == "fp8" else mc.dtype_bytes
        draft = self._draft_config
        extra = 0 if draft is None else draft.kv_bytes_per_token(  # type: ignore[attr-defined]
            self.config.cache_config.cache_dtype)
        return (mc.kv_entries_per_token * self.num_kv_tensors * self.num_local_kv_heads
                * mc.head_dim * elem + extra)

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank's memory holds (the executor takes the minimum
        over ranks: one block table serves them all)."""
        mc, cc, sc = self.config.model_config, self.config.cache_config, \
            self.config.scheduler_config
        if mc.runner == "pooling":
            return 2  # no KV cache: the smallest pool (null + 1) the scheduler takes
        per_block = self.kv_bytes_per_token() * cc.block_size
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = self._gpu_kv_budget()
            else:
                want = (sc.max_num_seqs * mc.max_model_len + cc.block_size) * \
                    self.kv_bytes_per_token()
                budget = min(DEFAULT_CPU_KV_BYTES, want)
        num_blocks = int(budget // per_block)
        groups = cc.kv_cache_groups
        need = (groups.blocks_per_request(mc.max_model_len, cc.block_size,
                                          sc.max_num_batched_tokens)
                if groups is not None and groups.hybrid  # (sliding groups: the window's)
                else -(-mc.max_model_len // cc.block_size)) + 1  # +1: the null block
        if num_blocks < need:
            raise ValueError(self._too_small_message(max(budget, 0), num_blocks, need))
        if self.device.type == "cpu":  # before torch.zeros touches it page by page
            check_cpu_kv_fits(num_blocks * per_block, self.config)
        return num_blocks

    def _allocate_offload_pool(self, num_blocks: int) -> None:
        """The prefix cache's host tier: ``num_offload_blocks`` host blocks shaped like
        this rank's KV blocks (pinned beside a GPU); logs both pools' sizes."""
        cc = self.config.cache_config
        self.offload_caches = allocate_swap_space(cc.num_offload_blocks, self.kv_caches[0],
                                                  len(self.kv_caches))
        per_block = cc.kv_offload_block_bytes  # the whole model's
        logger.info("prefix cache pools: device %d blocks (%.2f GiB), host %d blocks "
                    "(%.2f GiB)", num_blocks - 1, (num_blocks - 1) * per_block / 2**30,
                    cc.num_offload_blocks, cc.num_offload_blocks * per_block / 2**30)
        n = getattr(cc, "num_offload_disk_blocks", 0)
        if n:
            self.disk_pool = DiskPool(n, self.offload_caches, cc.kv_offload_disk_path)
            logger.info("prefix cache disk pool: %d blocks (%d bytes, %.2f GiB; this "
                        "rank's file %.2f GiB) in %s", n, n * per_block,
                        n * per_block / 2**30, n * self.disk_pool.block_bytes / 2**30,
                        self.disk_pool.dir)

    def _too_small_message(self, budget: int, num_blocks: int, need: int) -> str:
        """Why a KV budget cannot hold one max_model_len request, and what to change."""
        mc, cc = self.config.model_config, self.config.cache_config
        per_block = mc.kv_bytes_per_token() * cc.block_size
        fits = max(0, (num_blocks - 1) * cc.block_size)
        if cc.kv_cache_memory_bytes is not None:
            source = f"{budget} bytes"
            fix = f"raise --kv-cache-memory-bytes to at least {need * per_block}"
        elif self.device.type == "cuda":
            source = f"the memory plan's {budget} bytes"
            fix = "raise --gpu-memory-utilization or free device memory"
        else:
            source = f"the default {budget} bytes"
            fix = f"set --kv-cache-memory-bytes to at least {need * per_block}"
        if fits > 0:
            fix += f", or lower --max-model-len to {fits}"
        return (f"kv_cache_memory_bytes: {source} hold {max(num_blocks - 1, 0)} KV blocks "
                f"({fits} tokens), fewer than one request of max_model_len "
                f"({mc.max_model_len}) needs ({need - 1} blocks): {fix}")

    def _gpu_kv_budget(self) -> int:
        """Memory plan: ``gpu_memory_utilization`` x total, minus weights, the profiled
        activation peak of a maximal batch, memory outside torch (CUDA context, other
        processes) and a margin for CUDA graphs."""
        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_peak = profile_run(self)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        graph_margin = 0 if self.config.device_config.enforce_eager else \
            self._graph_margin(profile_peak - weights)
        self.graph_margin = graph_margin
        lora = self._lora_slot_bytes()  # allocated with the model runner, after this
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - \
            profile_peak - max(outside_torch, 0) - graph_margin - lora
        logger.info(
            "memory plan: total %.1f GiB x %.2f; weights %.2f GiB, activation peak %.2f "
            "GiB, outside torch %.2f GiB, graphs %.2f GiB, LoRA slots %.2f GiB -> KV cache "
            "%.2f GiB", total / 2**30, self.config.cache_config.gpu_memory_utilization,
            weights / 2**30, (profile_peak - weights) / 2**30, outside_torch / 2**30,
            graph_margin / 2**30, lora / 2**30, budget / 2**30)
        return budget

    def _lora_slot_bytes(self) -> int:
        """Device bytes of the LoRA adapter slots (``worker/lora/manager.py``), 0 without LoRA."""
        lc = self.config.lora_config
        if lc is None:
            return 0
        from pagedllm.worker.lora.manager import activation_dtype, lora_slot_bytes

        return lora_slot_bytes(self.model, lc.max_loras, lc.max_lora_rank,
                               activation_dtype(self.config.model_config))

    def _graph_margin(self, activation_peak: int) -> int:
        """The graphs' share of the memory plan (``cuda_graphs.graph_memory_margin``)."""
        mc, sc = self.config.model_config, self.config.scheduler_config
        chunks = chunk_capture_sizes(sc.max_num_batched_tokens, mc.max_model_len,
                                     self.config.device_config.max_cudagraph_capture_size)
        return graph_memory_margin(activation_peak, profile_tokens(sc, mc.max_model_len),
                                   chunks[-1] if chunks else 0)

    def initialize_cache(self, num_blocks: int) -> None:
        mc, cc = self.config.model_config, self.config.cache_config
        self.config = self.config.with_num_blocks(num_blocks)
        if mc.runner == "pooling":
            from pagedllm.worker.pooling_runner import PoolingModelRunner

            self.runner = PoolingModelRunner(  # type: ignore[assignment]
                self.config, self.model, self.device, self.kv_dtype)
            logger.info("pooling runner (%s pooling, tasks %s): no KV cache",
                        mc.pooler_config.pooling_type if mc.pooler_config else "?",
                        ", ".join(mc.pooler_config.tasks if mc.pooler_config else ()))
            return
        # (2 = keys, values) for GQA; (1 = the latent entry) for MLA.
        shape = (mc.kv_entries_per_token, num_blocks, cc.block_size, self.num_local_kv_heads,
                 mc.head_dim)
        start, end = self.local_layers
        # Zeroed, not empty: attention gathers whole blocks and masks the tail, and
        # garbage NaNs would survive a zero attention weight.
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                          for _ in range(self.num_kv_tensors)]
        bind_kv_cache_groups(self.model, self.kv_caches, cc.kv_cache_groups, start, end)
        if self.config.scheduler_config.preemption_mode == "swap":
            # The whole model's block size: the same CPU block count on every rank.
            per_block = mc.kv_bytes_per_token(cc.cache_dtype) * cc.block_size \
                * len(self.kv_caches) // (end - start)
            self.num_cpu_blocks = cc.swap_space_bytes // per_block
            self.swap_caches = allocate_swap_space(self.num_cpu_blocks, self.kv_caches[0],
                                                   len(self.kv_caches))
            logger.info("swap space: %d CPU blocks (%.2f GiB)", self.num_cpu_blocks,
                        self.num_cpu_blocks * per_block / 2**30)
        if cc.num_offload_blocks:
            self._allocate_offload_pool(num_blocks)
        self.runner = ModelRunner(self.config, self.model, self.device, self.parallel)
        self.runner.block_ops = BlockOps(self.kv_caches, self.swap_caches,
                                         self.offload_caches, self.disk_pool)
        if self.draft_model is not None:
            from pagedllm.worker.spec_decode.draft_model import DraftModelProposer, attach_draft
            from pagedllm.worker.spec_decode.eagle_proposer import EagleProposer

            method = self.config.scheduler_config.speculative_config.method
            attach_draft(self.runner, self.draft_model, self.config, self.kv_dtype,
                         DraftModelProposer if method == "draft_model" else EagleProposer)
        # Pipeline stages exchange hidden states between graph replays: run them eagerly.
        # A model's ``cuda_graph_steps`` ("all", "decode" or "none") limits what is
        # captured (a model whose prompt-chunk attention plans on the host: "decode").
        if self.device.type == "cuda" and not self.config.device_config.enforce_eager \
                and self.parallel.pp_size == 1 \
                and getattr(self.model, "cuda_graph_steps", "all") != "none":
            self.runner.capture_cuda_graphs(self.graph_margin)
        # Only the last pipeline stage has an LM head.
        if self.device.type == "cuda" and self.parallel.pp.is_last:
            t0 = time.perf_counter()
            warm_logits_and_sampling(self)
            logger.info("warmed lm_head at 1-%d rows and the sampler in %.2f s",
                        self.config.scheduler_config.max_num_seqs, time.perf_counter() - t0)
        spec = self.config.scheduler_config.speculative_config
        if spec is not None:  # the speculation policy's input (spec_decode/policy.py)
            t0 = time.perf_counter()
            sc = self.config.scheduler_config
            self.step_cost = measure_step_cost(self.runner, sc.max_num_seqs,
                                               sc.max_num_batched_tokens,
                                               spec.num_speculative_tokens)
            logger.info("step-cost curve for speculative decoding (%.2f s): %s",
                        time.perf_counter() - t0, self.step_cost.describe())
        tokens = (num_blocks - 1) * cc.block_size
        kv_bytes = mc.kv_bytes_per_token(cc.cache_dtype)
        gained = ""
        if cc.cache_dtype != "auto":  # what the same memory would hold in the model dtype
            auto_blocks = num_blocks * kv_bytes // mc.kv_bytes_per_token()
            gained = f", {num_blocks - auto_blocks} more than {mc.dtype} ({auto_blocks - 1})"
        logger.info(
            "KV cache (%s, %s, %d bytes per token): %d blocks of %d tokens (%d tokens, "
            "%.2f GiB%s); max concurrency at max_model_len %d: %.2fx",
            str(self.kv_dtype).replace("torch.", ""),
            "MLA latent" if mc.use_mla else "K and V", self.kv_bytes_per_token(),
            num_blocks - 1, cc.block_size, tokens,
            num_blocks * cc.block_size * self.kv_bytes_per_token() / 2**30, gained,
            mc.max_model_len, tokens / mc.max_model_len)
        if self.device.type == "cuda":
            from pagedllm.kernels.compile_stats import snapshot

            st = snapshot()
            logger.info("Triton: %d kernel variants compiled (%.1f s of compiler time), "
                        "%d loaded from the cache", st.compiled, st.compile_s, st.cache_hits)

    def fill_step_sizes(self) -> list[int]:
        """Token counts the throughput policy fills a mixed step up to: the chunk CUDA
        graphs' sizes (a step pads up to one) that lie on or near the lower convex hull
        of their replay times (``core.prefill_pacing.fill_sizes``); none when running
        eagerly."""
        graphs = self.runner.graphs if self.runner is not None else None
        curve = curve_from_graphs(graphs) if graphs is not None else None
        if curve is None:
            return []
        costs = curve.mixed  # the kept chunk graphs' replay times at capture
        sizes = fill_sizes(costs)
        if len(sizes) < len(costs) and self.config.scheduler_config.policy == "throughput":
            logger.info("throughput policy: mixed steps fill up to %s tokens (left out, "
                        "dearer than their neighbours per token: %s)",
                        ",".join(map(str, sizes)),
                        ",".join(str(t) for t, _ in costs if t not in sizes))
        return sizes

    def step_cost_curve(self) -> dict[str, Any] | None:
        """The measured step-cost curve as plain lists (None without speculation)."""
        return self.step_cost.to_dict() if self.step_cost is not None else None

    def set_grammar_compiler(self, compiler: object) -> None:
        """Where the runner finds structured-output grammars (the core's compiler)."""
        assert self.runner is not None, "initialize_cache first"
        if isinstance(self.runner, ModelRunner):  # a pooling runner samples nothing
            self.runner.grammar.compiler = compiler

    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        assert self.runner is not None, "initialize_cache first"
        self._moe_dummy_pass(sched)
        return self.runner.execute_model_async(sched)

    def record_sampled_tokens(self, req_ids: list[str],
                              sampled_token_ids: list[list[int]]) -> None:
        """Pipeline parallelism: tokens the last stage sampled in earlier steps (see
        ``worker/pipeline.py``); the last stage's ranks sampled them themselves."""
        assert self.runner is not None, "initialize_cache first"
        if not self.parallel.pp.is_last:
            self.runner.record_sampled_tokens(req_ids, sampled_token_ids)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache first"
        self._moe_dummy_pass(sched)
        return self.runner.execute_model(sched)

    def _moe_dummy_pass(self, sched: SchedulerOutput) -> None:
        """Experts across data-parallel engines: a step with no tokens here still takes
        part in every MoE layer's collectives, in order, so the other engines' tokens
        reach this rank's experts (engine/dp_lockstep.py)."""
        if sched.total_num_scheduled_tokens == 0 and self.parallel.dp.world_size > 1:
            from pagedllm.layers.fused_moe.dispatch import moe_dummy_pass

            with torch.inference_mode():
                moe_dummy_pass(self.model)

    def shutdown(self) -> None:
        """Drop every reference to device memory -- the model runner (its CUDA graphs and
        staging buffers), the weights (with them the quantised GEMMs' shared scratch), the
        draft model, the KV and swap caches -- and leave the world (idempotent).  The memory
        returns once the model's own reference cycles are collected: ``LLM.shutdown``
        collects them (``gc_heap.release_gc_heap``)."""
        self.runner = None
        self.model = None
        self.draft_model = None
        self.kv_caches = []
        self.swap_caches = []
        self.offload_caches = []
        if self.disk_pool is not None:  # (removes its private directory)
            self.disk_pool.close()
            self.disk_pool = None
        if self.parallel is not SINGLE_RANK:
            destroy_parallel_state()
