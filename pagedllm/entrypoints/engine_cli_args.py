"""Command-line flags shared by every subcommand that builds an engine (generate, chat,
serve, bench), named as in vLLM, and their conversion to ``EngineArgs``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.config import DTYPES, KV_CACHE_DTYPES
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.quantization import quantization_names


def _json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (argparse turns ArgumentTypeError into a one-line
    usage error naming the flag, exit status 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


_SIZE_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _byte_count(text: str) -> int:
    """argparse type: a whole number of bytes, written ``12000000000``, ``12e9``,
    ``12g`` (decimal: k m g t) or ``12G`` (binary: K M G T), as vLLM's size flags."""
    t = text.strip()
    mult = _SIZE_SUFFIX.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult != 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 12000000000, 12e9, 12g or 12G, got {text!r}"
        ) from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return int(value)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="A GGUF file or a Hugging Face model directory (config.json + "
                        "safetensors + tokenizer). Default: the embedded "
                        "SmolLM2-135M-Instruct.")
    g.add_argument("--tokenizer", default=None,
                   help="Tokenizer directory, if not the model's own.")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="Weight and activation dtype. auto = float32 on CPU, the "
                        "checkpoint's bf16/fp16 on GPU.")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Longest sequence (prompt + output) in tokens. Default: the "
                        "model's max_position_embeddings.")
    g.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"],
                   help="How to load weights; 'dummy' = random weights from the config "
                        "alone (benchmarks).")
    g.add_argument("--model-loader-extra-config", type=_json_object, default=None,
                   metavar="JSON",
                   help='Loader options as a JSON object.  One key: {"dummy_init": '
                        '"uniform"} (the default with --load-format dummy: vLLM\'s '
                        'uniform(-1e-3, 1e-3) on every weight) or "normal" '
                        '(normal(0, 0.02), norm weights 1: well-separated logits).')
    g.add_argument("--quantization", "-q", default=None,
                   help="Quantisation method of the linear layers. Default: detected "
                        "from the checkpoint (config.json's quantization_config, GGUF "
                        "tensor types); a method name quantises an unquantised checkpoint "
                        "at load where the method can; 'none' keeps unquantised weights. "
                        "Choices: " + ", ".join(quantization_names()) + ".")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type: 'auto' (the model dtype) or 'fp8' / "
                        "'fp8_e4m3' (e4m3 with per-tensor k/v scales from the checkpoint, "
                        "1.0 by default: twice the blocks of a bf16 cache).")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="With --kv-cache-dtype fp8: each layer's k/v scales from the "
                        "first batch's amax (/200 keys, /100 values, as vLLM), then "
                        "frozen; without it the checkpoint's scales or 1.0.")
    g.add_argument("--seed", type=int, default=0,
                   help="Seed for dummy weights and for unseeded random sampling.")
    g.add_argument("--block-size", type=int, default=16,
                   help="Tokens per KV cache block.")
    g.add_argument("--kv-cache-memory-bytes", type=_byte_count, default=None,
                   help="Bytes for the KV cache, e.g. 12e9, 12g or 12G (overrides "
                        "--gpu-memory-utilization; on CPU default 1 GiB).")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="Fraction of GPU memory the engine may use (weights + "
                        "activations + KV cache).")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="Most sequences running at once.")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="Token budget of one engine step (prompt chunks + decodes). "
                        "Default 8192 on CUDA, 2048 on the CPU.")
    g.add_argument("--scheduling-policy", default=None,
                   choices=["fcfs", "priority", "throughput"],
                   help="fcfs: first come first served; priority: lower 'priority' "
                        "value first, then arrival; throughput: for offline batches -- "
                        "requests of known length (ignore_eos, or min_tokens == "
                        "max_tokens) longest first, their prefill paced over the decode "
                        "horizon so decode steps carry it; others first come first "
                        "served (not for online serving: it delays prompts). Default: "
                        "throughput for offline runs on CUDA (bench throughput), fcfs "
                        "otherwise (a server; the CPU, where pacing slows decode steps).")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="Where to run. auto = cuda when available.")
    g.add_argument("--enforce-eager", action="store_true",
                   help="Never capture CUDA graphs.")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=2048,
                   help="Tokens of the largest CUDA graph for steps with prompt chunks "
                        "(decode-only steps have graphs up to --max-num-seqs). Steps with "
                        "more tokens run eagerly: their kernel launches cost host time "
                        "(15-65 ms a step measured on a 32-layer model). "
                        "Raise it (e.g. to the step budget, 8192) for small models whose "
                        "large steps are host-bound; each graph up to it is captured at "
                        "start-up and its activations are set aside from the KV cache. "
                        "0 = decode graphs only.")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="Schedule the next step while the device runs the current one "
                        "(default: on for CUDA, off for CPU).")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="Reuse KV blocks of identical prompt prefixes "
                                      "(on by default).")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="One block table for every layer even when the model mixes "
                        "sliding-window and full attention layers (Gemma 2/3): sliding "
                        "layers then keep the whole context's KV.")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="When KV blocks run out: drop a request's KV and recompute it "
                        "later, or swap it to CPU memory and back.")
    g.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of CPU memory for swapped-out KV blocks (pinned on GPU "
                        "machines); used with --preemption-mode swap.")
    g.add_argument("--kv-offload-size", "--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory for the prefix cache's second tier: KV blocks "
                        "evicted from the device pool wait there and are loaded back on "
                        "a prefix hit (0: off; vLLM's --kv-offloading-size).")
    g.add_argument("--kv-offload-disk-size", type=float, default=0.0, metavar="GiB",
                   help="GiB of local disk for the prefix cache's third tier: blocks "
                        "the host tier (--kv-offload-size, required) evicts go to a "
                        "memory-mapped file and are loaded back on a prefix hit "
                        "(default: 0, off).")
    g.add_argument("--kv-offload-disk-path", default=None, metavar="DIR",
                   help="Directory for the disk tier's file, in a private subdirectory "
                        "removed at shutdown (default: the system's temp directory, "
                        "e.g. $TMPDIR or /tmp).")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="Load no tokenizer (e.g. a dummy-weight benchmark model with only "
                        "config.json): prompts must be token ids, and outputs carry token "
                        "ids with empty text.")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Allow model repositories to run their own code (off by default).")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='Speculative decoding, a JSON object (vLLM\'s keys), e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\', or a draft model sharing the '
                        'target\'s vocabulary: \'{"model": PATH, '
                        '"num_speculative_tokens": 4}\'.')
    g = p.add_argument_group("pooling models (`pagedllm models` lists each architecture's "
                             "tasks)")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate: a decoder generates text; pooling: the model embeds or "
                        "scores (/v1/embeddings, /score, /rerank; no KV cache).  auto: "
                        "pooling for encoders and cross-encoders, generate for decoders.")
    g.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify"],
                   help="Serve a decoder as a pooling model: embed = last-token pooling, "
                        "normalised (Qwen3-Embedding).  auto: embed under --runner pooling.")
    g.add_argument("--pooler-config", type=_json_object, default=None, metavar="JSON",
                   help='Override the pooler: {"pooling_type": "CLS"|"MEAN"|"LAST", '
                        '"normalize": true|false}.  Default: the checkpoint\'s '
                        "sentence-transformers modules.json, else CLS (encoders) / LAST "
                        "(decoders), normalised.")
    add_parallel_args(p)
    add_lora_args(p)
    add_multimodal_args(p)


def add_multimodal_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multimodal")
    g.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                   metavar="JSON",
                   help='Most items of each modality one prompt may carry, e.g. '
                        '\'{"image": 2}\' (vLLM\'s flag; more is a 400 / ValueError naming '
                        'it). Default: 999 images. Vision-language models only.')
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                   help="Vision-encoder tokens one engine step may run (the encoder "
                        "budget). Default: --max-num-batched-tokens.")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true",
                   help="Serve PEFT LoRA adapters on top of the base model.")
    g.add_argument("--max-loras", type=int, default=1,
                   help="Adapters resident on the device, and most distinct adapters in "
                        "one step.")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="Largest adapter rank accepted (slots are sized for it).")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="Adapters kept in host memory (default: --max-loras).")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="Ranks each layer is split across (column/row-parallel linears, "
                        "vocabulary-parallel embedding and LM head).")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="Pipeline stages, each running a contiguous range of layers.")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="Engine cores behind one API server (see "
                        "--data-parallel-routing).")
    g.add_argument("--data-parallel-routing", default="prefix", choices=["prefix", "load"],
                   help="How requests are placed on data-parallel engines: 'prefix' sends "
                        "one to the engine that already caches at least half of its "
                        "prompt (a conversation's next turn goes where its history is) "
                        "unless that engine has more than max(4, 25%%) more unfinished "
                        "requests than the least-loaded one, else by load; 'load' by "
                        "load alone.  Default: %(default)s.")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "ray"],
                   help="How ranks run: in process (uni), one process each on this host "
                        "(mp) or Ray actors across nodes (ray).  Default: uni for one "
                        "rank, ray inside a Ray session, else mp.")
    g.add_argument("--distributed-timeout-seconds", type=float, default=60.0,
                   help="Start-up collectives and each step's wait for the ranks time "
                        "out after this long, naming the rank.")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: place whole experts on the ranks (each holds "
                        "num_experts / (tp x dp)) instead of slicing every expert; with "
                        "--data-parallel-size > 1 the engines step in lockstep and "
                        "dispatch tokens to their experts' ranks.")
    g.add_argument("--all2all-backend", default="allgather_reducescatter",
                   choices=["allgather_reducescatter", "alltoall"],
                   help="Expert parallelism across data-parallel engines: how tokens "
                        "reach their experts -- gather every engine's tokens and "
                        "reduce-scatter the results, or send each (token, expert) pair "
                        "to its expert's rank.  Default: %(default)s.")


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
        max_model_len=args.max_model_len, load_format=args.load_format, seed=args.seed,
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        calculate_kv_scales=getattr(args, "calculate_kv_scales", False),
        model_loader_extra_config=getattr(args, "model_loader_extra_config", None),
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy, device=args.device,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        num_threads=args.num_threads,
        enable_prefix_caching=args.enable_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        kv_offload_bytes=int(getattr(args, "kv_offload_size", 0.0) * (1 << 30)),
        kv_offload_disk_bytes=int(getattr(args, "kv_offload_disk_size", 0.0) * (1 << 30)),
        kv_offload_disk_path=getattr(args, "kv_offload_disk_path", None),
        trust_remote_code=args.trust_remote_code,
        speculative_config=getattr(args, "speculative_config", None),
        served_model_name=getattr(args, "served_model_name", None),
        skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        data_parallel_routing=args.data_parallel_routing,
        distributed_executor_backend=args.distributed_executor_backend,
        distributed_timeout_seconds=args.distributed_timeout_seconds,
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        all2all_backend=getattr(args, "all2all_backend", "allgather_reducescatter"),
        runner=getattr(args, "runner", "auto"), convert=getattr(args, "convert", "auto"),
        pooler_config=getattr(args, "pooler_config", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),
        max_num_encoder_input_tokens=getattr(args, "max_num_encoder_input_tokens", None))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; higher = more random.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (0, 1].")
    g.add_argument("--top-k", type=int, default=-1, help="Keep the k most likely (-1 = all).")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="Drop tokens below min_p x the top probability.")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages repeating prompt/output tokens.")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="Per-request seed for reproducible sampling.")
    g.add_argument("--stop", action="append", default=None,
                   help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
