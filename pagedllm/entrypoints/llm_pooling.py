"""The offline API of pooling models (vLLM's names): ``LLM.encode``, ``embed``,
``classify`` and ``score``; mixed into ``LLM`` (``entrypoints/llm.py``).

``score(text_1, text_2)`` pairs one text with many (1 -> N) or N with N; a cross-encoder
(task ``score``) reads each pair together, an embedding model scores the cosine of the
two embeddings (as vLLM does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagedllm.engine.input_processor import normalise_prompts
from pagedllm.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    as_task_output,
)
from pagedllm.pooling_params import PoolingParams


def pair_up(text_1: Any, text_2: Any) -> list[tuple[str, str]]:
    """vLLM's score pairing: ``str x str``, ``str x list`` (1 -> N), ``list x list``
    (N -> N, equal lengths); ValueError naming ``text_1``/``text_2`` otherwise."""
    one_1, one_2 = isinstance(text_1, str), isinstance(text_2, str)
    left = [text_1] if one_1 else list(text_1) if isinstance(text_1, Sequence) else None
    right = [text_2] if one_2 else list(text_2) if isinstance(text_2, Sequence) else None
    if left is None or not left:
        raise ValueError("text_1 must be a string or a non-empty list of strings")
    if right is None or not right:
        raise ValueError("text_2 must be a string or a non-empty list of strings")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"text_1 and text_2: {len(left)} and {len(right)} texts; pass "
                         "one text_1, or as many as text_2")
    for t in left + right:
        if not isinstance(t, str) or not t:
            raise ValueError("text_1 and text_2 must hold non-empty strings")
    return list(zip(left, right))


class PoolingMixin:
    """Needs ``self.llm_engine``, ``self._counter`` and ``self._run_to_completion``
    (``LLM``)."""

    llm_engine: Any
    _counter: Any
    _run_to_completion: Any

    def supported_tasks(self) -> tuple[str, ...]:
        pc = self.llm_engine.config.model_config.pooler_config
        return ("generate",) if pc is None else pc.tasks

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[
            PoolingParams] | None = None, use_tqdm: bool = False,
            pooling_task: str = "encode") -> list[PoolingRequestOutput]:
        """The pooled result of every prompt (``PoolingRequestOutput``, in order).
        Every prompt is validated before any runs (``ValueError`` names the problem)."""
        plist = normalise_prompts(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task=pooling_task)
        if isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * len(plist)
        else:
            params = list(pooling_params)
            if len(params) != len(plist):
                raise ValueError(f"pooling_params: got {len(params)} for {len(plist)} "
                                 "prompts; pass one, or one per prompt")
        params = [p if p.task == pooling_task else dataclasses.replace(p, task=pooling_task)
                  for p in params]
        return self._run_pooling(plist, params, use_tqdm)

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[
            PoolingParams] | None = None, use_tqdm: bool = False,
            ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [as_task_output(o, "embed") for o in outs]

    def classify(self, prompts: Any, use_tqdm: bool = False,
                 pooling_params: PoolingParams | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """A sequence-classification model's probabilities (``outputs.probs``)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")
        return [as_task_output(o, "classify") for o in outs]

    def score(self, text_1: Any, text_2: Any, use_tqdm: bool = False,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each ``(text_1, text_2)`` pair (``outputs.score``): a
        cross-encoder's sigmoid/softmax score, or the cosine of two embeddings."""
        pairs = pair_up(text_1, text_2)
        tasks = self.supported_tasks()
        if "score" in tasks:
            ip = self.llm_engine.input_processor
            plist, params = [], []
            base = pooling_params or PoolingParams(task="score")
            for a, b in pairs:
                ids, types = ip.tokenize_pair(a, b)
                plist.append({"prompt_token_ids": ids})
                params.append(dataclasses.replace(base, task="score", token_type_ids=types))
            outs = self._run_pooling(plist, params, use_tqdm)
            return [as_task_output(o, "score") for o in outs]
        if "embed" not in tasks:
            raise ValueError(f"score: this model's tasks are {', '.join(tasks)}; scoring "
                             "needs a cross-encoder or an embedding model")
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        seconds = [b for _, b in pairs]
        embs = self.embed(firsts + seconds, PoolingParams(task="embed", normalize=True),
                          use_tqdm)
        first_emb = {t: e.outputs.embedding for t, e in zip(firsts, embs)}
        out = []
        for (a, _), e2 in zip(pairs, embs[len(firsts):]):
            e1 = first_emb[a]
            score = sum(x * y for x, y in zip(e1, e2.outputs.embedding))
            out.append(PoolingRequestOutput(e2.request_id, ScoringOutput(score),
                                            e2.prompt_token_ids, True, e2.metrics))
        return out

    def _run_pooling(self, plist: list[Any], params: list[PoolingParams],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        rids = [str(next(self._counter)) for _ in plist]
        processed = [engine.input_processor.process_pooling(rid, p, pp)
                     for rid, p, pp in zip(rids, plist, params)]
        return self._run_to_completion(rids, processed, use_tqdm)
