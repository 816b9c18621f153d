"""Results of pooling requests, with vLLM's class and field names.

``LLM.encode`` returns ``PoolingRequestOutput`` (``outputs.data``: the pooled vector, a
list of floats here where vLLM holds a tensor); ``LLM.embed`` ->
``EmbeddingRequestOutput`` (``outputs.embedding``), ``LLM.classify`` ->
``ClassificationRequestOutput`` (``outputs.probs``), ``LLM.score`` ->
``ScoringRequestOutput`` (``outputs.score``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedllm.outputs import RequestMetrics

T = TypeVar("T")


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


def as_task_output(out: PoolingRequestOutput[PoolingOutput], task: str,
                   ) -> PoolingRequestOutput:
    """The task's view of a raw pooled result (``embed``, ``classify``, ``score``;
    ``encode`` keeps ``PoolingOutput``).  A score is the one label's value; a
    multi-label model's score is its last label's probability, as vLLM's."""
    data = out.outputs.data
    view: object
    if task == "embed":
        view = EmbeddingOutput(data)
    elif task == "classify":
        view = ClassificationOutput(data)
    elif task == "score":
        view = ScoringOutput(data[-1])
    else:
        view = out.outputs
    return PoolingRequestOutput(out.request_id, view, out.prompt_token_ids, out.finished,
                                out.metrics)
