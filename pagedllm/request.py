"""The engine-side request: one sequence the scheduler tracks (torch-free).

A request has ``num_tokens`` (prompt + generated so far) and ``num_computed_tokens``
(how many of them have their K/V in the cache).  Each step the scheduler grants it
``num_tokens - num_computed_tokens`` new tokens or fewer; nothing else distinguishes a
prefill from a decode.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from pagedllm.lora.request import LoRARequest
from pagedllm.messages import EngineCoreRequest, FinishReason
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute preemption: back in the waiting queue, KV dropped
    SWAPPED = 3  # swap preemption: KV parked in CPU blocks, resumes where it stopped
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Mutable per-request state owned by the scheduler.

    ``all_token_ids`` grows by append only (O(1) per token); nothing here is recomputed
    from the full sequence per step.  ``num_tokens`` and ``num_output_tokens`` are plain
    attributes, not ``len()`` properties, because the scheduler reads them several times
    per request per step: only ``append_output_token_id`` (and ``fork``) may change the
    token lists, and they keep the counts in step.
    """

    __slots__ = (
        "num_placeholders",
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority",
        "arrival_time", "output_token_ids", "all_token_ids", "num_computed_tokens",
        "num_tokens", "num_output_tokens",
        "status", "stop_reason", "num_preemptions", "max_tokens", "num_cached_tokens",
        "first_scheduled_time", "_first_scheduled_reported",
        # Memory sharing (issue 5): see the docstring of ``__init__``.
        "fork_ids", "reserved_slots", "beam_group", "token_override", "cpu_block_ids",
        # A pooling request's parameters (core/pooling_scheduler.py), else None.
        "pooling_params",
        "lora_request",
        "spec_token_ids",
        "length_known",
        "mm_features",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None,
                 arrival_time: float | None = None, priority: int = 0,
                 fork_ids: list[str] | None = None,
                 lora_request: LoRARequest | None = None) -> None:
        """``fork_ids``: ids of the extra parallel samples (n > 1) this request forks into
        once its prompt is computed up to the last token; they share its blocks.

        ``reserved_slots`` counts sequences this request will still fork into (they are
        reserved against ``max_num_seqs`` while it runs); ``beam_group`` names the beam
        search group it belongs to; ``token_override`` is a token the scheduler chose
        (beam search) that the runner must write over the one it sampled;
        ``cpu_block_ids`` holds its KV while swapped out.
        """
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)  # prompt + generated so far
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        assert sampling_params.max_tokens is not None, "engine fills in max_tokens"
        self.max_tokens: int = sampling_params.max_tokens
        # It generates exactly max_tokens tokens: no EOS, stop token, stop string or
        # grammar can end it earlier (the throughput policy plans only with such lengths).
        sp = sampling_params
        self.length_known: bool = not sp.stop and sp.structured_outputs is None and (
            sp.min_tokens >= self.max_tokens
            or (sp.ignore_eos and not sp.stop_token_ids))
        self.num_cached_tokens = -1  # set when first scheduled (prefix-cache hits)
        self.first_scheduled_time: float | None = None
        self._first_scheduled_reported = False
        self.fork_ids: list[str] = list(fork_ids or ())
        self.reserved_slots = len(self.fork_ids)
        self.beam_group: str | None = None
        self.token_override: int | None = None
        # Tokens being sampled by steps already launched but not yet reported back
        # (async scheduling: step N+1 is scheduled before step N's tokens arrive).
        self.num_placeholders = 0
        self.cpu_block_ids: list[int] | None = None
        self.lora_request = lora_request  # LoRA adapter (lora/), None: base model
        self.pooling_params: Any = None
        # Speculative decoding: drafts proposed after the last step, verified (as
        # scheduled tokens) in the next one; never part of ``all_token_ids``.
        self.spec_token_ids: list[int] = []
        # Images: placeholder runs (offset, length) and identifiers the prefix cache and
        # the encoder budget read; their tensors go to the runner with the request.
        self.mm_features: list[MultiModalFeature] = []

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        request = cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                      req.eos_token_id, req.arrival_time, req.priority, req.fork_ids,
                      req.lora_request)
        request.pooling_params = req.pooling_params
        request.mm_features = list(req.mm_features)
        return request

    def fork(self, child_id: str, sampling_params: SamplingParams | None = None) -> Request:
        """A new request with this one's tokens so far (no blocks: the KV manager shares
        those).  It inherits arrival, priority, cache and scheduling metadata."""
        child = Request(child_id, self.prompt_token_ids,
                        sampling_params or self.sampling_params, self.eos_token_id,
                        self.arrival_time, self.priority, lora_request=self.lora_request)
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_tokens, child.num_output_tokens = self.num_tokens, self.num_output_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child._first_scheduled_reported = self._first_scheduled_reported
        child.beam_group = self.beam_group
        child.mm_features = self.mm_features
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one generated token, keeping the counts in step."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        self.num_output_tokens += 1

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower ``priority`` first, then earlier arrival (vLLM's rule)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
