"""Turn engine-core token outputs into ``RequestOutput``s: detokenise incrementally,
apply stop strings, attach logprobs, and fan ``n`` child sequences back into one request.

A stop string is found here, in the frontend, after the core already generated the token:
the request is then reported finished and returned in ``reqs_to_abort`` so the caller
aborts it in the core (vLLM's design; the core never sees text).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedllm.engine.input_processor import child_request_id
from pagedllm.messages import EngineCoreOutputs, FinishReason, LogprobsLists
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagedllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    FINAL_ONLY = 0  # one RequestOutput when the request finishes (offline LLM)
    DELTA = 1  # each output carries only what is new (streaming)
    CUMULATIVE = 2  # each output carries everything so far


class OutputSink(Protocol):
    def put(self, item: RequestOutput | BaseException) -> None: ...


@dataclass(slots=True)
class _Seq:
    """One of the n sequences of a request."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    seqs: list[_Seq]
    sink: OutputSink | None
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    # A pooling request's vector (``EngineCoreOutput.pooling_output``).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                    sink: OutputSink | None = None) -> list[str]:
        """Track a request; returns the core request ids of its sequences."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = []
        ids = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            seq = _Seq(i, detok)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            seqs.append(seq)
            cid = request_id if params.n == 1 else child_request_id(request_id, i)
            self.child_to_parent[cid] = (request_id, i)
            ids.append(cid)
        state = _RequestState(
            request_id, prompt, prompt_token_ids, params, kind, seqs, sink,
            RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        return ids

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its core ids for the caller to abort in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [cid for cid, (p, _) in self.child_to_parent.items() if p == request_id] \
            if state.params.n > 1 else [request_id]
        for cid in ids:
            self.child_to_parent.pop(cid, None)
        return ids

    # -- conversion --------------------------------------------------------------------
    def _logprob_dicts(self, lp: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            d: dict[int, Logprob] = {}
            for j, (t, v) in enumerate(zip(ids, lps)):
                if t in d:
                    continue  # the chosen token is also in the top-k
                text = decode_token(self.tokenizer, t) if self.tokenizer is not None else None
                d[t] = Logprob(v, rank if j == 0 else j, text)
            out.append(d)
        return out

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Fold one engine step's outputs into the requests' states.

        Returns the ``RequestOutput``s due now (those of requests without a sink; the
        others are put into their sinks) and the core ids to abort (stop strings).  The
        common case -- one new token of a non-streaming request with no text, logprobs
        or stop strings to look at -- touches only the token list and the metrics.
        """
        now = time.time()
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        child_to_parent = self.child_to_parent
        requests = self.requests
        final_only = RequestOutputKind.FINAL_ONLY
        for eo in core_outputs.outputs:
            rid = eo.request_id
            parent = child_to_parent.get(rid)
            if parent is None:
                continue  # aborted by the caller meanwhile
            state = requests[parent[0]]
            seq = state.seqs[parent[1]]
            m = state.metrics
            if eo.first_scheduled_time is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = eo.first_scheduled_time
                m.time_in_queue = eo.first_scheduled_time - m.arrival_time
            state.num_cached_tokens = eo.num_cached_tokens
            if eo.pooling_output is not None:
                state.pooled = eo.pooling_output
            if eo.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._logprob_dicts(eo.new_prompt_logprobs))
            new_ids = eo.new_token_ids
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                m.num_generation_tokens += len(new_ids)
                seq.token_ids.extend(new_ids)
            if eo.cumulative_logprob is not None:  # beam search: the whole score
                seq.cumulative_logprob = eo.cumulative_logprob
            if eo.new_logprobs is not None and seq.logprobs is not None:
                seq.logprobs.extend(self._logprob_dicts(eo.new_logprobs))
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(
                    row[0] for row in eo.new_logprobs.logprobs)
            # An EOS / stop-token finish: that token's text is not part of the output.
            stop_str = seq.detok.update(
                new_ids, stop_terminated=eo.finish_reason == FinishReason.STOP,
            ) if (seq.detok is not None and new_ids) else None
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = str(FinishReason.STOP), stop_str
                if eo.finish_reason is None:
                    to_abort.append(rid)
            elif eo.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = str(eo.finish_reason), eo.stop_reason
            # The request can only have finished now if this sequence just did (a
            # finished sequence gets no more outputs: its id is forgotten here).
            finished = False
            if seq.finish_reason is not None:
                child_to_parent.pop(rid, None)
                finished = state.finished
            if finished or state.kind is not final_only:
                out = self._make_output(state, seq, finished)
                if state.sink is not None:
                    state.sink.put(out)
                else:
                    results.append(out)
            if finished:
                m.finished_time = now
                requests.pop(state.request_id, None)
        return ProcessedOutputs(results, to_abort)

    def fail_all(self, error: BaseException) -> None:
        """Deliver ``error`` to every streaming request (engine death) and forget all."""
        for state in self.requests.values():
            if state.sink is not None:
                state.sink.put(error)
        self.requests.clear()
        self.child_to_parent.clear()

    def _completion(self, seq: _Seq, kind: RequestOutputKind) -> CompletionOutput:
        finished = seq.finish_reason is not None
        if kind is RequestOutputKind.DELTA:
            text = seq.detok.get_next_output_text(finished, delta=True) if seq.detok else ""
            token_ids = seq.token_ids[seq.sent_tokens:]
            logprobs = seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else None
            seq.sent_tokens = len(seq.token_ids)
            seq.sent_logprobs = len(seq.logprobs or ())
        else:
            text = seq.detok.get_next_output_text(finished, delta=False) if seq.detok else ""
            token_ids = list(seq.token_ids)
            logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, token_ids, seq.cumulative_logprob, logprobs,
                                seq.finish_reason, seq.stop_reason)

    def _make_output(self, state: _RequestState, seq: _Seq, finished: bool,
                     ) -> RequestOutput | PoolingRequestOutput:
        """The output to report after ``seq`` changed (``finished``: the request did).
        Only called for a FINAL_ONLY request once it has finished.  A pooling request
        gets a ``PoolingRequestOutput`` (its task's view is the caller's)."""
        if state.pooled is not None:
            return PoolingRequestOutput(state.request_id, PoolingOutput(state.pooled),
                                        state.prompt_token_ids, finished, state.metrics)
        if state.kind is RequestOutputKind.FINAL_ONLY:
            outputs = [self._completion(s, state.kind) for s in state.seqs]
        else:
            # Streaming: report the sequence that changed.
            outputs = [self._completion(seq, state.kind)]
        prompt_lp = state.prompt_logprobs
        if state.kind is RequestOutputKind.DELTA and prompt_lp is not None:
            if state.sent_prompt_logprobs:
                prompt_lp = None
            else:
                state.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_lp,
            outputs=outputs, finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics)
