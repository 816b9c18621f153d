"""The vision-language side of ``bench throughput --workload V1`` and ``bench latency
--workload V1`` (issue 41): the model's image placeholder run for V1's prompts, and the
runner's encoder cache counters and encoder timer, read in process.

    V1 request = [<|vision_start|> <|image_pad|> x N <|vision_end|>] + 64..256 text ids
                  N from the model's own processor (448x448 -> 256 on Qwen2.5-VL)

The encoder cache lives in the model runner (``worker/encoder_cache.py``); a benchmark
whose engine core runs in this process reads it there (None otherwise: the figures are
then left out).  Its timer is off in the engine; ``EncoderProbe`` switches it on (CUDA
events on a GPU, read once after the timed run: no host sync inside a step).
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.benchmarks.workloads import inproc_runner
from pagedllm.multimodal.processor import MultiModalProcessor


def image_run(llm: Any, image_size: int) -> list[int]:
    """The expanded placeholder run of one ``image_size``-square image: the image token
    as many times as the processor expands it, between the vision start / end tokens
    when the config names them.  ``ValueError`` for a text-only model."""
    from pagedllm.benchmarks.workloads import synthetic_image

    mm = llm.llm_engine.input_processor.mm
    if mm is None:
        raise ValueError("--workload V1 needs a vision-language model (e.g. --dummy "
                         "qwen2.5-vl-7b)")
    image = synthetic_image(0, image_size)
    counts = MultiModalProcessor._tokens_per_image(mm.hf_processor, [image])
    if counts is None or mm.image_token_id is None:
        raise ValueError("--workload V1: the model's processor does not say how many "
                         "placeholder tokens an image takes")
    n = counts[0]
    cfg = llm.llm_engine.config.model_config.hf_config
    start = getattr(cfg, "vision_start_token_id", None)
    end = getattr(cfg, "vision_end_token_id", None)
    run = [mm.image_token_id] * n
    return ([start] if start is not None else []) + run + ([end] if end is not None else [])


def processor_seconds(llm: Any, prompts: list[Any]) -> float:
    """Seconds the front end's processor takes for ``prompts`` (run once more, outside
    any timed run): the part of V1's wall time and TTFT spent before the engine core."""
    ip = llm.llm_engine.input_processor
    t0 = time.perf_counter()
    for p in prompts:
        ip.tokenize_multimodal(p)
    return time.perf_counter() - t0


def encoder_cache_of(llm: Any) -> Any:
    """The in-process model runner's encoder cache (None: a text-only model, or an
    engine core in another process)."""
    return getattr(inproc_runner(llm), "mm", None)


class EncoderProbe:
    """Deltas of the encoder cache over a span of runs: images encoded, cache hits (an
    image requested while another request holds its encoding), seconds in the encoder."""

    def __init__(self, llm: Any) -> None:
        self.cache = encoder_cache_of(llm)
        self.timer = self.cache.start_timing() if self.cache is not None else None
        self._base = self._now()

    def _now(self) -> tuple[int, int, float]:
        if self.cache is None:
            return 0, 0, 0.0
        return self.cache.num_encoded, self.cache.num_hits, self.timer.seconds()

    def reset(self) -> None:
        self._base = self._now()

    def stats(self, wall_s: float) -> dict[str, Any]:
        """Since the last reset; ``wall_s``: the span's wall time, for the share."""
        if self.cache is None:
            return {"encoder_stats": "not available (engine core in another process)"}
        enc, hits, sec = (a - b for a, b in zip(self._now(), self._base))
        return {"images_encoded": enc, "encoder_cache_hits": hits,
                "encoder_cache_hit_rate": hits / max(1, enc + hits),
                "encoder_s": sec, "encoder_share": sec / wall_s if wall_s > 0 else 0.0}
