"""User-facing results, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# As above for prompt positions; the first prompt token has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    encoder_prompt: None = field(default=None, repr=False)

    def add(self, later: RequestOutput) -> None:
        """Fold ``later``, the next *delta* of the same request, into this one (vLLM's
        ``RequestOutput.add(..., aggregate=True)``): per sequence index, text, token ids
        and logprobs are appended and the finish state is the later one's; a sequence
        only ``later`` reports is added.  Used when a slow consumer finds several deltas
        queued, so that it sends one chunk instead of many.  Lists are copied on first
        merge, never extended in place, so no other holder of them sees a change."""
        mine = {c.index: i for i, c in enumerate(self.outputs)}
        for c in later.outputs:
            i = mine.get(c.index)
            if i is None:
                mine[c.index] = len(self.outputs)
                self.outputs.append(c)
                continue
            old = self.outputs[i]
            logprobs = old.logprobs
            if c.logprobs is not None:
                logprobs = [*(logprobs or ()), *c.logprobs]
            self.outputs[i] = CompletionOutput(
                old.index, old.text + c.text, [*old.token_ids, *c.token_ids],
                c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics or self.metrics
