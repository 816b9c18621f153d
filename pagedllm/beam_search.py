"""Beam search's user-facing types, with vLLM's names (``vllm.beam_search``).

``LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))`` returns one
``BeamSearchOutput`` per prompt whose ``sequences`` are the ``beam_width`` best
hypotheses, best first.  The search itself runs in the engine core, in the scheduler's
``BeamSearchCoordinator`` (``core/beam_search.py``), on shared KV blocks with
copy-on-write; it follows Hugging Face Transformers' ``generate(num_beams=k,
do_sample=False, length_penalty=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    """``beam_width`` beams; ``max_tokens`` generated at most; a finished hypothesis
    scores ``sum of logprobs / generated_len ** length_penalty``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only 0 (deterministic) is supported
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` = prompt + generated (vLLM's convention), ``text`` the
    decoded generated part appended to the prompt text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]
