"""Messages between the frontend (LLM / API server) and the engine core.

They are msgspec Structs so the same objects travel in-process (offline ``LLM``) and over
ZeroMQ as msgpack (server): no pickle anywhere.  An ``n > 1`` request (parallel sampling or
beam search) is one core request naming its n sequence ids (``request_id`` + ``fork_ids``):
the core computes the prompt once and forks; the frontend fans the n outputs back in.
"""

from __future__ import annotations

import enum

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a sequence finished; ``str()`` gives the OpenAI/vLLM spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """One sequence to generate.  Prompt already tokenised and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    # n > 1 (parallel sampling or beam search): the ids sequences 1..n-1 report under;
    # ``request_id`` is sequence 0.  The core computes the prompt once and forks.
    fork_ids: list[str] = msgspec.field(default_factory=list)
    # A pooling request (runner "pooling"): one step, no KV, one vector back
    # (``sampling_params`` is then a placeholder the core does not read).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter this request runs with (lora/), None: the base model.
    lora_request: LoRARequest | None = None
    # Images (multimodal/inputs.py): placeholder runs in ``prompt_token_ids`` (sorted by
    # offset), content identifiers and processed tensors; empty for text.
    mm_features: list[MultiModalFeature] = msgspec.field(default_factory=list)


class LogprobsLists(msgspec.Struct, array_like=True):
    """Per position: ``token_ids[i][0]`` is the chosen (sampled or prompt) token and
    ``token_ids[i][1:]`` the top-k alternatives; ``ranks[i]`` is the chosen token's rank
    (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """What happened to one sequence in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Beam search reports each final sequence whole, with its score's log probability.
    cumulative_logprob: float | None = None
    # Wall-clock time the request was first scheduled (set once; for queue-time metrics).
    first_scheduled_time: float | None = None
    # A pooling request's result (``PoolingParams.task`` decides what it holds).
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the scheduler after a step (feeds Prometheus gauges/counters)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0  # in this step
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Tokens computed by the step this snapshot follows (0 for idle/heartbeat snapshots).
    num_scheduled_tokens: int = 0
    # Speculative decoding in this step (vLLM's spec_decode_* counters): requests that
    # verified drafts, drafts verified, drafts accepted, accepted per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # The prefix cache's host tier (core/offload_tier.py), since the last snapshot:
    # tokens looked up past the device hit and found there (or on its disk tier), bytes
    # copied each way; its fill (0..1) and size in blocks (0: off).
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_usage: float = 0.0
    kv_offload_total_blocks: int = 0
    # Its disk tier (core/disk_tier.py), likewise: tokens looked up past the device and
    # host hits and found on disk, bytes host -> disk and disk -> host, fill, size.
    kv_offload_disk_queries: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_bytes_to_disk: int = 0
    kv_offload_bytes_from_disk: int = 0
    kv_offload_disk_usage: float = 0.0
    kv_offload_disk_total_blocks: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Set when the core hit an unrecoverable error; the frontend fails in-flight requests.
    engine_error: str | None = None
