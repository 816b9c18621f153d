"""Helpers the vision-language model tests share: greedy parameters, the engine's token
ids, and transformers' expectation for a ``(path, model, processor)`` checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm import LLM, SamplingParams

MAX = 8  # tokens generated per request unless a test says otherwise


def greedy(max_tokens: int = MAX, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list, params: SamplingParams | None = None) -> list[list[int]]:
    """The engine's token ids for each prompt (greedy ``MAX`` by default)."""
    outs = llm.generate(prompts, params or greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def expected(hf_generate: Callable[..., list[int]], ckpt: tuple, prompt: str,
             images: list, n: int = MAX) -> list[int]:
    """transformers' greedy ids through the family's ``hf_generate``."""
    _, model, processor = ckpt
    return hf_generate(model, processor, prompt, images, n)
