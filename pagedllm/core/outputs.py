"""What the scheduler tells the model runner, and what the runner answers (torch-free).

The scheduler sends *diffs*: a request's prompt and sampling parameters travel once (in
``NewRequestData``); afterwards only its newly allocated block ids and its token count for
the step.  The runner keeps everything else in its persistent per-request state.

The classes are slotted: the scheduler builds one ``CachedRequestData`` per running
request per step, and slots make that (and the runner's reads) measurably cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after a recompute preemption:
    then ``output_token_ids`` holds the tokens generated before it was preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    # A pooling request's ``PoolingParams`` (core/pooling_scheduler.py), else None.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    # Hybrid KV cache groups (core/hybrid_kv_cache_manager.py): the tables of groups
    # 1.. (``block_ids`` is group 0's); None with one group.
    group_block_ids: list[list[int]] | None = None
    # Images (multimodal/inputs.py): placeholder runs and tensors; empty for text.
    mm_features: list[MultiModalFeature] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: the blocks appended since last step.

    ``replaced_block_ids``: ``(table index, new block id)`` -- copy-on-write gave the
    request a private copy of a shared block (the copy itself is in
    ``SchedulerOutput.block_copies``).  ``last_token_id``: beam search chose this token;
    it replaces the last token of the runner's row (the one the runner sampled).
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
    last_token_id: int | None = None
    # Hybrid KV cache groups: ids appended to groups 1.. (``new_group_block_ids[g - 1]``)
    # and copy-on-write there, ``(group, table index, new block id)``; None: nothing.
    new_group_block_ids: list[list[int]] | None = None
    replaced_group_block_ids: list[tuple[int, int, int]] | None = None


@dataclass(slots=True)
class ForkRequestData:
    """Fork ``child_req_id`` from ``parent_req_id``: the runner copies the parent's row
    (tokens and block table -- the blocks themselves are shared, not copied) before it
    applies anything else of the step.  ``sampling_params`` is set when the child's
    differ from the parent's (parallel sample ``i`` is seeded with ``seed + i``)."""

    parent_req_id: str
    child_req_id: str
    sampling_params: SamplingParams | None = None


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order (new requests after cached).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Memory sharing.  The runner applies, in this order and before anything else:
    # forks (row copies), swap-outs (GPU block -> CPU block), prefix-cache offloads (GPU
    # block -> host slot), swap-ins (CPU -> GPU), prefix-cache loads (host slot -> GPU),
    # then block copies (copy-on-write, src -> dst); all before the forward writes any
    # KV (core/offload_tier.py for the host tier's two lists).
    forks: list[ForkRequestData] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_offload: list[tuple[int, int]] = field(default_factory=list)
    kv_load: list[tuple[int, int]] = field(default_factory=list)
    # The prefix cache's disk tier (core/disk_tier.py), applied before the host tier's
    # two lists: host slot -> disk slot saves, then disk slot -> host slot loads.
    kv_disk_save: list[tuple[int, int]] = field(default_factory=list)
    kv_disk_load: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: req_id -> draft tokens to verify this step (they are the
    # last ``len(drafts)`` of its ``num_scheduled_tokens``; spec_decode/).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and how many drafts per request the runner proposes after this step for the
    # next one (the per-step policy's guess; 0: none, spec_decode/policy.py).
    num_spec_proposals: int = 0
    # Images (core/encoder_budget.py): req_id -> indices into its ``mm_features`` to
    # encode this step (before the forward), and to release after it (their placeholder
    # runs are computed by the end of this step).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class LogprobsLists:
    """Host-side logprobs of a step: row i = i-th sampled request (see pagedllm.messages)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request, in ``req_ids`` order: the tokens sampled this step (empty
    for a prompt chunk that did not reach the end of the prompt; with drafts, the
    accepted ones and one more)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> (token_ids [k+1], logprobs [k+1], rank) for requests that asked.
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # req_id -> prompt logprobs for the prompt positions computed this step.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Pooling runner: req_id -> the request's pooled result (worker/pooling_runner.py).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: req_id -> drafts proposed for the next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> why the runner could not run it as asked (its LoRA adapter failed to
    # load): the scheduler finishes it (abort) and reports nothing else for it.
    failed: dict[str, str] = field(default_factory=dict)
