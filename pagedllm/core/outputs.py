"""What the scheduler tells the model runner, and what the runner answers (torch-free).

The scheduler sends *diffs*: a request's prompt and sampling parameters travel once (in
``NewRequestData``); afterwards only its newly allocated block ids and its token count for
the step.  The runner keeps everything else in its persistent per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass
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


@dataclass
class CachedRequestData:
    """A request the runner already holds: the blocks appended since last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order (new requests after cached).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Host-side logprobs of a step: row i = i-th sampled request (see engine.messages)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in ``req_ids`` order: the tokens sampled this step (empty
    for a prompt chunk that did not reach the end of the prompt)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> (token_ids [k+1], logprobs [k+1], rank) for requests that asked.
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # req_id -> prompt logprobs for the prompt positions computed this step.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
