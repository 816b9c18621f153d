"""Engine configuration: frozen dataclasses built once from CLI flags or ``LLM(**kwargs)``.

Plain data only.  ``EngineArgs`` (what the user typed, vLLM's names) and
``EngineArgs.create_engine_config``, which validates it, resolves the model and the KV
cache groups and returns an ``EngineConfig``, live above in ``engine/arg_utils.py``.  This
module imports no torch and nothing above the torch-free core, so that ``core/`` (which
reads ``SchedulerConfig`` and ``CacheConfig``) and every layer can read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.model_files.resolve import ResolvedModel
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.pooling_params import PoolerConfig
from pagedllm.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16")


@dataclass(frozen=True)
class ModelConfig:
    """The model, its tokenizer and the numbers derived from its HF config."""

    resolved: ResolvedModel
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    load_format: str
    seed: int
    served_model_name: str
    skip_tokenizer_init: bool
    trust_remote_code: bool
    # How load_format="dummy" draws weights (EngineArgs.model_loader_extra_config).
    dummy_init: str = "uniform"
    # The linear layers' quantisation method (layers/quantization/), None = the dtype
    # above; resolved from quantization= and the checkpoint.
    quantization: str | None = None
    # "generate" or "pooling" (models/pooling_setup.py); a pooling model's pooler.
    runner: str = "generate"
    convert: str = "none"
    pooler_config: PoolerConfig | None = None
    # A vision-language model's settings (multimodal/config.py); None: text only.
    multimodal_config: MultiModalConfig | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def use_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, ``layers/mla.py``): the KV cache
        stores one latent entry per token instead of per-head keys and values."""
        return bool(getattr(self.hf_config, "kv_lora_rank", None))

    @property
    def kv_entries_per_token(self) -> int:
        """Leading dimension of a layer's KV tensor: 2 (keys, values) for GQA, 1 for MLA
        (``[c_kv | k_pe]``); generic code indexes ``cache[:, block_ids]`` either way."""
        return 1 if self.use_mla else 2

    @property
    def num_kv_heads(self) -> int:
        """KV heads as the cache stores them (MLA: one latent "head")."""
        c = self.hf_config
        if self.use_mla:
            return 1
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """Elements per KV head in the cache (MLA: ``kv_lora_rank + qk_rope_head_dim``)."""
        c = self.hf_config
        if self.use_mla:
            return int(c.kv_lora_rank) + int(c.qk_rope_head_dim)
        hd = getattr(c, "head_dim", None)
        return int(hd) if hd else int(c.hidden_size // c.num_attention_heads)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def kv_bytes_per_token(self, cache_dtype: str = "auto") -> int:
        """Bytes of K and V (MLA: of the latent entry), all layers, for one token, in a
        KV cache of ``cache_dtype`` (``CacheConfig.cache_dtype``: "auto" = the model
        dtype, "fp8" = 1 byte)."""
        elem = 1 if cache_dtype == "fp8" else self.dtype_bytes
        return (self.kv_entries_per_token * self.num_layers * self.num_kv_heads
                * self.head_dim * elem)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # CPU memory for swapped-out KV blocks (allocated only with preemption_mode="swap").
    swap_space_bytes: int = 4 << 30
    # The prefix cache's host tier (core/offload_tier.py): host memory for KV blocks
    # evicted from the device pool (0: off), and the blocks it holds -- the whole
    # model's block size, the same count on every rank (set by the engine arguments).
    kv_offload_bytes: int = 0
    num_offload_blocks: int = 0
    kv_offload_block_bytes: int = 0
    # Its disk tier (core/disk_tier.py): bytes of a memory-mapped file for blocks the
    # host tier evicts (0: off), the blocks it holds (same block size), and the
    # directory its private temp directory goes in (None: the system's temp dir).
    kv_offload_disk_bytes: int = 0
    num_offload_disk_blocks: int = 0
    kv_offload_disk_path: str | None = None
    # Filled in by the engine once memory is planned.
    num_blocks: int | None = None
    # Every layer's attention window when all layers slide with one (Mistral v0.1): KV
    # blocks behind it are freed (core/kv_cache_manager.py).  Set from the model config.
    sliding_window: int | None = None
    # Which layers share a block table (core/kv_cache_groups.py): one group, or with the
    # hybrid manager one per attention kind's share of layers.  Set from the model config.
    kv_cache_groups: KVCacheGroups | None = None
    # The KV cache's element type: "auto" (the model dtype) or "fp8" (e4m3 with
    # per-tensor k/v scales, attention/kv_cache_dtype.py).
    cache_dtype: str = "auto"
    # fp8 cache only: each layer's k/v scales from the first real batch's amax, then
    # frozen (vLLM's calculate_kv_scales; layers/kv_scales.py).
    calculate_kv_scales: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # "throughput": offline batches; longest max_tokens first, prefill paced over the
    # decode horizon (core/prefill_pacing.py).
    policy: Literal["fcfs", "priority", "throughput"] = "fcfs"
    # How a preempted request gives back its blocks: drop and recompute them later, or
    # copy them to CPU swap space and back.
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Swap bandwidth the scheduler may spend per step, in blocks (in + out).
    max_swap_blocks_per_step: int = 64
    # Schedule step N+1 while step N runs on the device (its tokens arrive one step
    # late); on by default on CUDA, where host work would otherwise idle the GPU.
    # Off with speculative decoding (a step's drafts come from its accepted tokens).
    async_scheduling: bool = False
    # Speculative decoding (spec_decode/): drafts are scheduled tokens; None = off.
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA: at most this many distinct adapters per step (0: LoRA off).
    max_loras: int = 0
    # Images: encoder input tokens per step (vLLM's name; 0: max_num_batched_tokens).
    max_num_encoder_input_tokens: int = 0
    # A model whose image tokens attend to their whole placeholder run (Gemma 3): no
    # chunk ends inside a run (core/encoder_budget.py); set from the model class.
    whole_placeholder_runs: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (``lora/``, vLLM's names): ``max_loras`` adapters resident on the
    device (and per step), ranks up to ``max_lora_rank``, ``max_cpu_loras`` kept on the
    host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" | "cuda"
    enforce_eager: bool = False
    num_threads: int | None = None
    # Largest token count of a chunk (non-decode) CUDA graph (worker/cuda_graphs.py).
    max_cudagraph_capture_size: int = 2048


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = field(default_factory=lambda: ParallelConfig())
    lora_config: LoRAConfig | None = None  # None: LoRA off

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        return dataclasses.replace(
            self, cache_config=dataclasses.replace(self.cache_config, num_blocks=num_blocks))


# vLLM's names; "fp8" and "fp8_e4m3" are the same e4m3 cache.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine is spread over ranks, and how many engines serve (data parallel).

    ``world_size = tensor_parallel_size * pipeline_parallel_size`` ranks per engine;
    ``data_parallel_size`` engines behind one API server.  ``distributed_executor_backend``
    is resolved once when the config is built (``engine/arg_utils.make_parallel_config``,
    ``executor/``): "uni" for one rank, else "ray" inside a Ray session, else "mp"
    (vLLM's rule, with the host's processes standing in for its GPUs).
    ``distributed_timeout_seconds`` bounds every start-up collective and every step's
    wait for the workers."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    distributed_timeout_seconds: float = 60.0
    # Whole experts per rank over the TP group instead of every expert replicated
    # (distributed/parallel_state.ParallelState.ep; docs/parallelism.md); with
    # data_parallel_size > 1 over every engine's TP ranks (EP size = DP x TP).
    enable_expert_parallel: bool = False
    # How MoE layers move tokens when experts span data-parallel engines (vLLM's
    # names): "allgather_reducescatter" or "alltoall" (layers/fused_moe/dispatch.py).
    all2all_backend: str = "allgather_reducescatter"
    # Expert parallelism across engines only: this engine's index, the loopback port of
    # the ranks' shared rendezvous and the port of the engine cores' step lockstep
    # (engine/dp_lockstep.py); set per engine by the DP client (engine/dp_client.py).
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0
    data_parallel_rpc_port: int = 0
    # How the DP client places requests on engines (engine/dp_routing.py): "prefix"
    # (the engine holding most of the prompt's prefix, unless clearly busier) or "load".
    data_parallel_routing: str = "prefix"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_spans_dp(self) -> bool:
        """Experts are spread over every data-parallel engine's ranks, so the engines
        step in lockstep and their ranks share one world."""
        return self.enable_expert_parallel and self.data_parallel_size > 1
