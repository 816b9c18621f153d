"""``EngineArgs``: what the user typed (CLI flags or ``LLM(**kwargs)``, vLLM's names), and
building the engine's configuration from it (vLLM's ``engine/arg_utils.py``).

``EngineArgs.create_engine_config`` validates every argument (``ValueError`` naming the
parameter), resolves the model (``model_files/resolve.py``), its quantisation, runner and
draft model, and the KV cache's layer groups, and returns the frozen ``EngineConfig`` of
``config.py``.  It reads models, layers and the worker's EAGLE head checks, so it sits
above them; ``config.py`` stays plain data that every layer may read.  Like ``config.py``
it imports no torch at module level (the entrypoints import it before any model code).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.attention.kinds import layer_sliding_windows, uniform_sliding_window
from pagedllm.config import (
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.engine.dp_routing import check_routing
from pagedllm.model_files.resolve import resolve_model
from pagedllm.multimodal.config import (
    MultiModalConfig,
    is_multimodal_config,
    lift_text_config,
)
from pagedllm.spec_decode.config import DRAFT_KV_METHODS, MODEL_METHODS, SpeculativeConfig

logger = logging.getLogger("pagedllm")

_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32",
                  "fp32": "float32", "bf16": "bfloat16"}

# Bytes the scheduler may swap per step: about 4 ms at PCIe 4.0 x16's ~16 GB/s, small
# next to a decode step, so swapping never stalls the running batch for long.
SWAP_BYTES_PER_STEP = 64 << 20


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


DUMMY_INITS = ("uniform", "normal")


def _whole_placeholder_runs(hf_config: Any, max_batched: int) -> bool:
    """Whether the vision-language model keeps each image's placeholder run in one step
    (its image tokens attend to the whole run: ``models/gemma3_mm.py``); ``ValueError``
    naming ``max_num_batched_tokens`` when a run cannot fit one step."""
    from pagedllm.models.registry import get_model_class

    cls = get_model_class(hf_config)
    if not getattr(cls, "whole_placeholder_runs", False):
        return False
    run = int(cls.max_placeholder_run(hf_config))  # type: ignore[attr-defined]
    if run > max_batched:
        raise ValueError(f"max_num_batched_tokens ({max_batched}) is below this model's "
                         f"image placeholder run ({run} tokens), which must compute in "
                         "one step")
    return True


def _dummy_init(extra: Any) -> str:
    """``model_loader_extra_config`` -> the dummy-weight distribution (ValueError naming
    the parameter for anything else)."""
    if extra is None:
        return "uniform"
    if not isinstance(extra, dict) or set(extra) - {"dummy_init"}:
        raise ValueError('model_loader_extra_config supports only {"dummy_init": ...}, '
                         f"got {extra!r}")
    init = extra.get("dummy_init", "uniform")
    if init not in DUMMY_INITS:
        raise ValueError(f"model_loader_extra_config: dummy_init must be one of "
                         f"{', '.join(DUMMY_INITS)}, got {init!r}")
    return str(init)


@dataclass
class EngineArgs:
    """User-facing engine arguments, named as in vLLM."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    # vLLM's name.  One key: {"dummy_init": "uniform" | "normal"} (load_format "dummy").
    model_loader_extra_config: dict[str, Any] | None = None
    # None: detect from the checkpoint (quantization_config / GGUF tensor types);
    # a method name quantises or checks; "none" keeps unquantised weights.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" | "fp8" | "fp8_e4m3"
    # fp8 KV cache: k/v scales from the first batch (vLLM's name; a no-op otherwise).
    calculate_kv_scales: bool = False
    seed: int = 0
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # vLLM's name: keep one block table for all layers of a model mixing sliding-window
    # and full attention (else sliding layers hold only their window's blocks).
    disable_hybrid_kv_cache_manager: bool = False
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks
    # Host memory for the prefix cache's second tier (core/offload_tier.py): cached KV
    # blocks evicted from the device pool wait there for a prefix hit.  0: off.
    kv_offload_bytes: int = 0
    # Local disk for its third tier (core/disk_tier.py): blocks the host tier evicts go
    # to a memory-mapped file of this many bytes (0: off; needs kv_offload_bytes), in a
    # private directory made under kv_offload_disk_path (None: the system's temp
    # directory) and removed at shutdown.
    kv_offload_disk_bytes: int = 0
    kv_offload_disk_path: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # "fcfs" | "priority" | "throughput"; None: the entry point's default -- fcfs for a
    # server or a bare engine; for the offline ``LLM`` throughput on CUDA, fcfs on the
    # CPU (``offline_scheduling_policy``).
    scheduling_policy: str | None = None
    device: str = "auto"
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 2048  # tokens of the largest chunk CUDA graph
    async_scheduling: bool | None = None  # None: on for CUDA, off for CPU
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    num_threads: int | None = None
    # Parallelism (executor/, distributed/): ranks per engine and engines per server.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: chosen (ParallelConfig)
    distributed_timeout_seconds: float = 60.0
    # MoE experts split whole over the TP ranks, and with data_parallel_size > 1 over
    # every engine's (vLLM's names; docs/parallelism.md).
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    # Set per engine by the DP client when experts span engines (engine/dp_client.py).
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0
    data_parallel_rpc_port: int = 0
    # "prefix" | "load": how requests are placed on data-parallel engines (dp_routing).
    data_parallel_routing: str = "prefix"
    # Pooling models (vLLM 0.26's names): "auto" | "generate" | "pooling"; a decoder
    # under runner "pooling" converts to "embed"; {"pooling_type", "normalize"}.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | None = None
    # Multi-LoRA (lora/): adapters per step / on the device, their largest rank, and
    # how many stay on the host (default: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, ...} (spec_decode/).
    speculative_config: dict[str, Any] | None = None
    # Vision-language models (multimodal/): {"image": N} images per prompt at most, and
    # encoder input tokens per step (None: max_num_batched_tokens).
    limit_mm_per_prompt: dict[str, int] | None = None
    max_num_encoder_input_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def create_engine_config(self, hf_config: Any = None) -> EngineConfig:
        """Validate and build.  ``hf_config`` replaces the model's transformers config
        (the start-up kernel warm-up passes config.json's raw keys,
        ``engine/kernel_warmup.py``); normally it is loaded here, and the log says how
        long that took and how many of transformers' modules it imported (on a fresh
        process, most of a start-up's config time)."""
        t0 = time.perf_counter()
        timing: dict[str, float] = {}
        config = self._build_engine_config(hf_config, timing)
        if hf_config is None:
            logger.info("built the engine config in %.1f s (the model's config %.1f s, "
                        "importing %d transformers modules on the way)",
                        time.perf_counter() - t0, timing.get("hf_config", 0.0),
                        int(timing.get("transformers_modules", 0)))
        return config

    def _build_engine_config(self, hf_config: Any, timing: dict[str, float]) -> EngineConfig:
        """``create_engine_config``'s body; ``timing`` gets the model config's seconds
        (``hf_config``) and the transformers modules imported meanwhile."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                "load_format must be one of auto, safetensors, gguf, dummy, "
                f"got {self.load_format!r}")
        dummy_init = _dummy_init(self.model_loader_extra_config)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got "
                             f"{self.block_size!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        policy = "fcfs" if self.scheduling_policy is None else self.scheduling_policy
        if policy not in ("fcfs", "priority", "throughput"):
            raise ValueError("scheduling_policy must be 'fcfs', 'priority' or 'throughput', "
                             f"got {policy!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")
        sw = self.swap_space
        if isinstance(sw, bool) or not isinstance(sw, (int, float)) or not 0 <= sw <= 1024:
            raise ValueError(f"swap_space must be a number of GiB in [0, 1024], got {sw!r}")

        lora = self._lora_config()
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        self._check_kv_offload(spec)
        self._check_kv_offload_disk()
        if spec is not None and self.pipeline_parallel_size != 1:
            raise ValueError("speculative_config is not supported with "
                             "pipeline_parallel_size > 1")
        if spec is not None and spec.method != "ngram" and self.async_scheduling:
            # A draft model's / EAGLE head's KV follows every step's accepted tokens.
            raise ValueError("async_scheduling is not supported with speculative_config "
                             f"method {spec.method!r} (leave it unset: it is then off)")

        device = self.device
        if device == "auto":
            device = _cuda_available() and "cuda" or "cpu"
        elif device == "cuda" and not _cuda_available():
            raise ValueError(_no_cuda_reason())
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        check_dtype_on_device(self.dtype, device)

        parallel = make_parallel_config(
            self.tensor_parallel_size, self.pipeline_parallel_size,
            self.data_parallel_size, self.distributed_executor_backend,
            self.distributed_timeout_seconds, self.enable_expert_parallel,
            self.all2all_backend, (self.data_parallel_rank, self.data_parallel_master_port,
                                   self.data_parallel_rpc_port),
            routing=self.data_parallel_routing)

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        cache_dtype = "auto" if self.kv_cache_dtype == "auto" else "fp8"
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got "
                             f"{self.calculate_kv_scales!r}")

        from pagedllm.layers.quantization import resolve_quantization

        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a string, got {self.quantization!r}")
        resolved = resolve_model(self.model, self.tokenizer, self.load_format)
        if hf_config is None:
            t0 = time.perf_counter()
            before = _transformers_modules()
            hf_config = resolved.load_hf_config(self.trust_remote_code)
            timing["hf_config"] = time.perf_counter() - t0
            # transformers imports lazily: the config class pulls in most of the library
            # (its first use in a process is most of this time).
            timing["transformers_modules"] = _transformers_modules() - before
        # A vision-language config: the engine reads the decoder's numbers at the top.
        hf_config = lift_text_config(hf_config)
        mm_config = MultiModalConfig.from_arg(self.limit_mm_per_prompt) \
            if is_multimodal_config(hf_config) else None
        if self.max_num_encoder_input_tokens is not None:
            _positive_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)
        quantization = resolve_quantization(
            self.quantization, hf_config,
            resolved.gguf_path if resolved.load_format == "gguf" else None, device)
        if quantization == "gguf" and parallel.tensor_parallel_size > 1:
            if self.quantization == "gguf":
                raise ValueError("quantization='gguf' (kept-quantised GGUF) runs on one rank "
                                 "only; use tensor_parallel_size 1 or quantization='none'")
            quantization = None  # detected, not asked for: dequantise, as before
        check_parallel_shapes(hf_config, parallel)
        if parallel.expert_parallel_spans_dp:
            _check_expert_parallel_across_engines(self.async_scheduling, spec)
        from pagedllm.models.pooling_setup import resolve_runner

        runner, convert, pooler = resolve_runner(hf_config, resolved.directory, self.runner,
                                                 self.convert, self.pooler_config)
        if runner == "pooling" and parallel.world_size > 1:
            raise ValueError("runner 'pooling' runs on one rank: use tensor_parallel_size "
                             "and pipeline_parallel_size 1 (data_parallel_size scales it)")
        if runner == "pooling" and parallel.expert_parallel_spans_dp:
            raise ValueError("runner 'pooling' does not run with enable_expert_parallel "
                             "across data-parallel engines (its engines do not step in "
                             "lockstep)")

        if dtype == "auto":
            # fp32 on CPU (the parity reference); the checkpoint's half type on GPU.
            # transformers 5 calls it ``dtype`` (reading ``torch_dtype`` warns that it is
            # deprecated); 4.x only has ``torch_dtype``.
            cfg_dtype = str((hf_config.dtype if hasattr(hf_config, "dtype") else
                             getattr(hf_config, "torch_dtype", None)) or "bfloat16")
            cfg_dtype = cfg_dtype.replace("torch.", "")
            if cfg_dtype not in ("bfloat16", "float16"):
                cfg_dtype = "bfloat16"
            dtype = "float32" if device == "cpu" else cfg_dtype

        derived_max = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        if getattr(hf_config, "model_type", None) == "xlm-roberta":
            # Its positions start after the padding index (models/bert.py).
            derived_max -= int(getattr(hf_config, "pad_token_id", 1) or 1) + 1
        max_model_len = derived_max if self.max_model_len is None else self.max_model_len
        _positive_int("max_model_len", max_model_len)
        if max_model_len > derived_max:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's "
                f"max_position_embeddings ({derived_max})")
        # GPU steps are compute-bound only from a few thousand tokens on, so the GPU
        # default is larger (vLLM picks 8192-16384 on this class of GPU); on the CPU a
        # smaller budget keeps decodes flowing while long prompts are chunked.
        max_batched = self.max_num_batched_tokens or (8192 if device == "cuda" else 2048)
        whole_runs = _whole_placeholder_runs(hf_config, max_batched) \
            if mm_config is not None else False
        model_config = ModelConfig(
            resolved=resolved, hf_config=hf_config, dtype=dtype,
            max_model_len=max_model_len, load_format=resolved.load_format, seed=self.seed,
            served_model_name=self.served_model_name or resolved.display_name,
            skip_tokenizer_init=self.skip_tokenizer_init,
            trust_remote_code=self.trust_remote_code, dummy_init=dummy_init,
            quantization=quantization, runner=runner, convert=convert,
            pooler_config=pooler, multimodal_config=mm_config)
        if spec is not None and spec.method in MODEL_METHODS:
            spec = dataclasses.replace(spec, draft_model_config=_draft_model_config(
                spec, model_config, self.quantization, parallel.world_size, device))
        elif spec is not None and spec.method == "mtp":  # the target's own MTP layer
            from pagedllm.worker.spec_decode.mtp import mtp_draft_config

            spec = dataclasses.replace(spec, draft_model_config=mtp_draft_config(
                model_config, parallel.world_size))
        # Pipeline stages hold different layers: one group there.
        kv_groups = make_kv_cache_groups(
            layer_sliding_windows(model_config.hf_config),
            hybrid=not self.disable_hybrid_kv_cache_manager
            and self.pipeline_parallel_size == 1)
        # One KV block of the whole model (hybrid groups share their tensors' pages).
        block_bytes = model_config.kv_bytes_per_token(cache_dtype) * self.block_size
        if kv_groups is not None and kv_groups.hybrid:
            block_bytes = block_bytes * kv_groups.num_tensors // model_config.num_layers
        num_offload = self.kv_offload_bytes // block_bytes
        if self.kv_offload_bytes and num_offload == 0:
            raise ValueError(f"kv_offload_bytes ({self.kv_offload_bytes}) holds no KV "
                             f"block: one is {block_bytes} bytes")
        num_disk = self.kv_offload_disk_bytes // block_bytes
        if self.kv_offload_disk_bytes and num_disk == 0:
            raise ValueError(f"kv_offload_disk_bytes ({self.kv_offload_disk_bytes}) holds "
                             f"no KV block: one is {block_bytes} bytes")
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=float(g),
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space_bytes=int(sw * (1 << 30)), cache_dtype=cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales and cache_dtype == "fp8",
                sliding_window=uniform_sliding_window(model_config.hf_config),
                kv_cache_groups=kv_groups, kv_offload_bytes=self.kv_offload_bytes,
                num_offload_blocks=num_offload, kv_offload_block_bytes=block_bytes,
                kv_offload_disk_bytes=self.kv_offload_disk_bytes,
                num_offload_disk_blocks=num_disk,
                kv_offload_disk_path=self.kv_offload_disk_path if num_disk else None),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                max_model_len=max_model_len, policy=policy,  # type: ignore
                preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
                max_swap_blocks_per_step=max(1, SWAP_BYTES_PER_STEP // (
                    model_config.kv_bytes_per_token(cache_dtype) * self.block_size)),
                # A draft model / EAGLE head follows each step's accepted tokens, so it
                # runs synchronously; n-gram speculation pauses async scheduling only
                # while the policy wants proposals (Scheduler.requires_sync).
                async_scheduling=(spec is None or spec.method == "ngram") and (
                    device == "cuda" if self.async_scheduling is None
                    else bool(self.async_scheduling))
                and not parallel.expert_parallel_spans_dp,
                max_loras=lora.max_loras if lora else 0,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens or 0,
                whole_placeholder_runs=whole_runs, speculative_config=spec),
            device_config=DeviceConfig(
                # Experts across engines: each MoE layer's collectives are sized by
                # every engine's tokens of the step, which a CUDA graph cannot replay.
                device=device,
                enforce_eager=self.enforce_eager or parallel.expert_parallel_spans_dp,
                num_threads=self.num_threads,
                max_cudagraph_capture_size=_positive_int(
                    "max_cudagraph_capture_size", self.max_cudagraph_capture_size, 0)),
            parallel_config=parallel, lora_config=lora,
        )

    def _check_kv_offload(self, spec: SpeculativeConfig | None) -> None:
        """``kv_offload_bytes``: bytes, at most the host's available memory, with the
        prefix cache on (ValueError naming it otherwise)."""
        ob = self.kv_offload_bytes
        if isinstance(ob, bool) or not isinstance(ob, int) or ob < 0:
            raise ValueError("kv_offload_bytes must be a number of bytes >= 0 (0: off), "
                             f"got {ob!r}")
        if ob == 0:
            return
        import psutil

        avail = psutil.virtual_memory().available
        dp = self.data_parallel_size if isinstance(self.data_parallel_size, int) else 1
        if ob * max(dp, 1) > avail:  # every data-parallel engine has its own host pool
            each = f" x data_parallel_size {dp}" if dp > 1 else ""
            raise ValueError(f"kv_offload_bytes ({ob} bytes, {ob / 2**30:.2f} GiB{each}) "
                             f"exceeds the host's available memory ({avail / 2**30:.2f} GiB)")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_bytes: the host tier extends the prefix cache; "
                             "it needs enable_prefix_caching on")
        if spec is not None and spec.method in DRAFT_KV_METHODS:
            raise ValueError("kv_offload_bytes: not supported with speculative_config "
                             f"method {spec.method!r} yet (the draft's KV stays on the "
                             "device)")

    def _check_kv_offload_disk(self) -> None:
        """``kv_offload_disk_bytes``: bytes, with the host tier on, at most the free
        space of the filesystem of ``kv_offload_disk_path`` (default: the system's temp
        directory), which must be a writable directory (ValueError naming the one at
        fault).  The path is not looked at while the disk tier is off."""
        import os
        import shutil
        import tempfile

        db = self.kv_offload_disk_bytes
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise ValueError("kv_offload_disk_bytes must be a number of bytes >= 0 (0: "
                             f"off), got {db!r}")
        if db == 0:
            return
        if not self.kv_offload_bytes:
            raise ValueError("kv_offload_disk_bytes: the disk tier keeps what the host "
                             "tier evicts; it needs kv_offload_bytes > 0")
        path = self.kv_offload_disk_path
        where = tempfile.gettempdir() if path is None else os.fspath(path)
        if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_disk_path ({where!r}) is not a writable "
                             "directory")
        free = shutil.disk_usage(where).free
        dp = self.data_parallel_size if isinstance(self.data_parallel_size, int) else 1
        if db * max(dp, 1) > free:  # every data-parallel engine has its own file
            each = f" x data_parallel_size {dp}" if dp > 1 else ""
            raise ValueError(f"kv_offload_disk_bytes ({db} bytes, {db / 2**30:.2f} GiB"
                             f"{each}) exceeds the free space of {where!r}'s filesystem "
                             f"({free / 2**30:.2f} GiB)")

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA settings (``ValueError`` naming the parameter), None when off."""
        if not self.enable_lora:
            return None
        n = _positive_int("max_loras", self.max_loras)
        rank = _positive_int("max_lora_rank", self.max_lora_rank)
        cpu = n if self.max_cpu_loras is None else _positive_int("max_cpu_loras",
                                                                 self.max_cpu_loras)
        if cpu < n:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({n})")
        return LoRAConfig(n, rank, cpu)


def _draft_model_config(spec: SpeculativeConfig, target: ModelConfig,
                        quantization: str | None, world_size: int,
                        device: str) -> ModelConfig:
    """The draft model of ``speculative_config`` (method "draft_model"): resolved like the
    target, in its dtype and context length; ValueError naming ``speculative_config``
    when it cannot propose for this target (another vocabulary, a shorter context)."""
    from pagedllm.layers.quantization import resolve_quantization

    assert spec.model is not None
    if uniform_sliding_window(target.hf_config) is not None:
        # The KV manager frees blocks behind the window and hands them to other
        # requests, while the draft's KV shares those blocks and attends to all of them.
        raise ValueError("speculative_config: a draft model is not supported with a "
                         "sliding-window target (its old blocks are freed)")
    if world_size != 1:
        raise ValueError("speculative_config: a draft model runs on one rank only; use "
                         "tensor_parallel_size 1")
    try:
        # A dummy-weight target (benchmarks) drafts with dummy weights too.
        resolved = resolve_model(spec.model, None,
                                 "dummy" if target.load_format == "dummy" else "auto")
    except ValueError as e:
        raise ValueError(f"speculative_config: {e}") from None
    hf = resolved.load_hf_config(target.trust_remote_code)
    vocab = int(getattr(hf, "vocab_size", 0) or 0)
    if vocab != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {spec.model} has vocab_size {vocab}, the "
            f"target {target.vocab_size}; a draft must share the target's vocabulary")
    if spec.method in ("eagle", "eagle3"):
        from pagedllm.worker.spec_decode.eagle import check_head, checkpoint_shapes

        check_head(spec.method, None if resolved.load_format == "dummy"
                   else checkpoint_shapes(resolved.directory), hf, target.hf_config)
    derived_max = int(getattr(hf, "max_position_embeddings", 2048) or 2048)
    # An EAGLE head's RoPE table is built to max_model_len (published heads say 2048).
    if derived_max < target.max_model_len and spec.method == "draft_model":
        raise ValueError(
            f"speculative_config: the draft model's max_position_embeddings ({derived_max}) "
            f"is below max_model_len ({target.max_model_len}); lower max_model_len")
    # The target's "none" (dequantise a GGUF) applies to the draft too, so that a model
    # drafting for itself computes exactly what the target computes.
    quant = resolve_quantization("none" if quantization == "none" else None, hf,
                                 resolved.gguf_path if resolved.load_format == "gguf"
                                 else None, device)
    return ModelConfig(
        resolved=resolved, hf_config=hf, dtype=target.dtype,
        max_model_len=target.max_model_len, load_format=resolved.load_format,
        seed=target.seed, served_model_name=resolved.display_name,
        skip_tokenizer_init=True, trust_remote_code=target.trust_remote_code,
        dummy_init=target.dummy_init, quantization=quant)


def offline_scheduling_policy(device: str) -> str:
    """The offline API's default ``scheduling_policy`` on ``device`` ("auto", "cpu" or
    "cuda"): ``throughput`` on CUDA, where a decode step's GEMMs read every weight
    however few rows it has, so paced prompt tokens ride along almost free (W1 +9-12%,
    W5 +7% on an H200); ``fcfs`` on the CPU, where a step costs about its tokens and
    only decode-only steps take the one-call C decoder (``models/cpu_decode_stack.py``), so
    pacing prompts into decode steps made W1-small on the default model slower (82
    against 125 output tok/s; docs/findings.md, "The offline API's default
    policy")."""
    on_gpu = device == "cuda" or (device == "auto" and _cuda_available())
    return "throughput" if on_gpu else "fcfs"


def check_dtype_on_device(dtype: str, device: str) -> None:
    """Raise ``ValueError`` naming ``dtype`` when the device cannot run it: float16 on
    the CPU (its matmuls are unusably slow there: a server never got ready).  Costs
    nothing unless float16 is asked for with device ``auto`` (then torch says whether
    CUDA is there), so a server may call it before spawning its engine core."""
    if _DTYPE_ALIASES.get(dtype, dtype) != "float16":
        return
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        raise ValueError(f"dtype: {dtype} is not supported on the CPU (--dtype); use "
                         "float32 (the CPU default, 'auto') or bfloat16, or run on a GPU")


def _no_cuda_reason() -> str:
    import torch

    why = ("this torch build has no CUDA support (a CPU-only wheel)"
           if torch.version.cuda is None else "torch sees no CUDA device")
    return f"device: 'cuda' was asked for but {why} (torch {torch.__version__}); use cpu"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def _transformers_modules() -> int:
    return sum(1 for name in list(sys.modules) if name.startswith("transformers"))


def _ray_session_active() -> bool:
    ray = sys.modules.get("ray")  # never import Ray just to ask
    return bool(ray is not None and ray.is_initialized())


def make_parallel_config(tp: object, pp: object, dp: object, backend: object,
                         timeout: object, expert_parallel: object = False,
                         all2all_backend: object = "allgather_reducescatter",
                         dp_placement: tuple[int, int, int] = (0, 0, 0),
                         routing: object = "prefix") -> ParallelConfig:
    """Validate the parallel arguments (``ValueError`` naming the parameter) and pick the
    executor backend when it is not given.  ``dp_placement``: this engine's
    ``(data_parallel_rank, data_parallel_master_port, data_parallel_rpc_port)``, set by
    the DP client when experts span engines; ``routing``: ``data_parallel_routing``."""
    tp = _positive_int("tensor_parallel_size", tp)
    pp = _positive_int("pipeline_parallel_size", pp)
    dp = _positive_int("data_parallel_size", dp)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"distributed_timeout_seconds must be a positive number, got "
                         f"{timeout!r}")
    if backend is None:
        backend = "uni" if tp * pp == 1 else ("ray" if _ray_session_active() else "mp")
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of "
                         f"{', '.join(EXECUTOR_BACKENDS)}, got {backend!r}")
    if backend == "uni" and tp * pp > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but "
                         f"tensor_parallel_size x pipeline_parallel_size = {tp * pp}")
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"enable_expert_parallel must be a bool, got {expert_parallel!r}")
    if expert_parallel and tp * dp == 1:
        raise ValueError("enable_expert_parallel spreads experts over tensor_parallel_size "
                         "x data_parallel_size ranks, but both are 1; use "
                         "tensor_parallel_size > 1 or data_parallel_size > 1")
    if all2all_backend not in ("allgather_reducescatter", "alltoall"):
        raise ValueError(f"all2all_backend must be 'allgather_reducescatter' or "
                         f"'alltoall', got {all2all_backend!r}")
    if expert_parallel and dp > 1:
        if pp > 1:
            raise ValueError("enable_expert_parallel with data_parallel_size > 1 needs "
                             "pipeline_parallel_size 1 (the engines step in lockstep)")
        if backend == "ray":
            raise ValueError("enable_expert_parallel with data_parallel_size > 1 runs on "
                             "one host: use distributed_executor_backend 'mp' or 'uni'")
    routing = check_routing(routing)
    rank, master, rpc = dp_placement
    return ParallelConfig(tp, pp, dp, str(backend), float(timeout), expert_parallel,
                          str(all2all_backend), rank, master, rpc, routing)


def _check_expert_parallel_across_engines(async_scheduling: object,
                                          spec: SpeculativeConfig | None) -> None:
    """Experts across data-parallel engines make every engine run one forward per
    lockstep step (engine/dp_lockstep.py): async scheduling (a step launched before the
    last one's tokens are read) and speculative decoding (extra draft forwards) would
    break the count, so they are refused (``ValueError`` naming them)."""
    if async_scheduling:
        raise ValueError("async_scheduling is not supported with enable_expert_parallel "
                         "and data_parallel_size > 1 (the engines step in lockstep); "
                         "leave it unset")
    if spec is not None:
        raise ValueError("speculative_config is not supported with enable_expert_parallel "
                         "and data_parallel_size > 1")


def num_routed_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (DeepSeek ``n_routed_experts``, Mixtral
    ``num_local_experts``, Qwen-MoE ``num_experts``); 0 for a dense model."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        n = getattr(hf_config, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def check_parallel_shapes(hf_config: Any, parallel: ParallelConfig) -> None:
    """``ValueError`` naming the parallel size the model's shapes cannot be split by
    (attention splits by whole KV-head groups: ``layers/linear.head_partition``)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    layers = int(getattr(hf_config, "num_hidden_layers", 1))
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {layers} layers")
    if parallel.enable_expert_parallel:
        experts = num_routed_experts(hf_config)
        if not experts:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model; "
                             "this one has no routed experts")
        ep = tp * (parallel.data_parallel_size if parallel.expert_parallel_spans_dp
                   else 1)
        if experts % ep:
            raise ValueError(f"enable_expert_parallel: the model's {experts} routed experts "
                             f"do not divide over the expert-parallel size {ep} "
                             f"(tensor_parallel_size x data_parallel_size)")
    elif tp > 1 and num_routed_experts(hf_config):
        # Without expert parallelism every expert (and a shared expert) is sliced.
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            n = int(getattr(hf_config, name, 0) or 0)
            if n % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                                 f"{name} ({n}); enable_expert_parallel keeps experts "
                                 f"whole")
    if tp == 1:
        return
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(getattr(hf_config, "intermediate_size", 0) or 0)
    vocab = int(hf_config.vocab_size)
    if kv < tp and (tp % kv or heads % tp):
        raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads "
                         f"({heads}) and be a multiple of num_key_value_heads ({kv})")
    for name, n in (("intermediate_size", inter), ("vocab_size", vocab)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                             f"{name} ({n})")
