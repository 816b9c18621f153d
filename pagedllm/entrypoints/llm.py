"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` as in vLLM."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs, offline_scheduling_policy
from pagedllm.engine.input_processor import PromptType, normalise_prompts
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm_pooling import PoolingMixin
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics_reader import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)} - {"model", "extra"}


class LLM(PoolingMixin):
    """An offline engine for batches of prompts.

    ``LLM()`` runs the embedded default model (SmolLM2-135M-Instruct); any ``EngineArgs``
    field (``dtype``, ``max_model_len``, ``kv_cache_memory_bytes``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``seed``, ...) may be passed by keyword.
    On CUDA its ``scheduling_policy`` defaults to ``"throughput"`` (a server's, and the
    CPU's, to ``"fcfs"``: ``config.offline_scheduling_policy``): requests that run to a
    known ``max_tokens`` (``ignore_eos``, or ``min_tokens == max_tokens``) are ordered
    and their prompts paced for the shortest total time; all others run first come,
    first served.
    Pooling models (``runner="pooling"``, chosen automatically for encoders and
    cross-encoders) serve ``embed``/``classify``/``score``/``encode``
    (``entrypoints/llm_pooling.py``) instead of ``generate``.

    ``shutdown()`` (or leaving ``with LLM(...) as llm:``) frees the weights, the KV cache
    and the CUDA graphs and stops the engine's processes and threads; dropping the last
    reference does the same (``weakref.finalize``: nothing in the engine refers back to
    the ``LLM``).  After it every call raises ``RuntimeError``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES - {"max_logprobs"})
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        dp = kwargs.get("data_parallel_size", 1)
        if isinstance(dp, int) and not isinstance(dp, bool) and dp > 1:
            # Not silently one engine (with expert parallelism it would wait for the
            # other engines' ranks until the distributed timeout).
            raise ValueError(f"data_parallel_size {dp}: the offline LLM runs one engine; "
                             f"data-parallel engines run behind the API server "
                             f"(pagedllm serve --data-parallel-size {dp}) or AsyncLLM")
        init_logger()
        max_logprobs = kwargs.pop("max_logprobs", 20)
        if kwargs.get("scheduling_policy") is None:
            # An offline batch: only its total time counts (docs/architecture.md,
            # "Scheduling policies"; requests that may stop early run as under FCFS).
            kwargs["scheduling_policy"] = offline_scheduling_policy(
                kwargs.get("device", "auto"))
        self.engine_args = EngineArgs(model=model, **kwargs)
        # The engine lives in a one-slot box shared with the finalizer, so that shutting
        # down (explicitly, or when this object is dropped) leaves no reference to it.
        self._engine_box: list[LLMEngine] = [
            LLMEngine(self.engine_args.create_engine_config(), max_logprobs)]
        self._finalizer = weakref.finalize(self, _shutdown_engine, self._engine_box)
        self._counter = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        if not self._engine_box:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); build a new one")
        return self._engine_box[0]

    def shutdown(self) -> None:
        """Free the engine's device and host memory (weights, KV cache, CUDA graphs) and
        stop its worker processes and threads, now (idempotent).  Later calls raise
        ``RuntimeError``."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True,
            priority: Sequence[int] | None = None,
            lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
            ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        ``lora_request``: the LoRA adapter for every prompt, or one (or None) per prompt
        (needs ``enable_lora=True``).  Every prompt and adapter is validated before any
        is queued, so a bad one raises ``ValueError`` and nothing runs.
        """
        plist = normalise_prompts(prompts)
        return self._run(plist, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: Any, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API): one ``BeamSearchOutput`` per prompt
        with ``params.beam_width`` sequences, best first.  Beams share KV blocks
        (copy-on-write); results match Hugging Face ``generate(num_beams=...)``."""
        sp = SamplingParams(n=params.beam_width, temperature=0.0,
                            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            use_beam_search=True, length_penalty=params.length_penalty,
                            include_stop_str_in_output=params.include_stop_str_in_output)
        outs = self._run(normalise_prompts(prompts), sp, use_tqdm, None)
        return [BeamSearchOutput([
            BeamSearchSequence(
                tokens=o.prompt_token_ids + c.token_ids, cum_logprob=c.cumulative_logprob
                or 0.0, text=(o.prompt or "") + c.text, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason)
            for c in o.outputs]) for o in outs]

    def get_metrics(self) -> list[Metric]:
        """A snapshot of this engine's metrics as vLLM's ``LLM.get_metrics()`` returns
        them (``pagedllm.metrics_reader``: ``Counter``, ``Gauge``, ``Histogram`` and
        ``Vector`` objects with ``name`` and ``labels``): the series a server exports at
        ``/metrics`` -- tokens, requests by finish reason, latencies, prefix-cache
        queries and hits, and with speculative decoding its drafts, draft and accepted
        tokens and acceptance per position."""
        from pagedllm.metrics_reader import snapshot

        return snapshot(self.llm_engine.metrics.registry)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (e.g. between benchmark runs); returns False,
        doing nothing, while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True,
            chat_template: str | None = None, add_generation_prompt: bool = True,
            tools: list[dict[str, Any]] | None = None,
            chat_template_kwargs: dict[str, Any] | None = None,
            ) -> list[RequestOutput]:
        """Chat completion(s): ``messages`` is one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of conversations.  ``tools`` (OpenAI
        function tools) are rendered as the server renders them -- the template's
        ``tools`` variable, or for a template without one an instruction in the system
        message -- and the reply is plain text (vLLM's offline contract: no tool
        parser runs).  ``chat_template_kwargs``: further template variables."""
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        ip = self.llm_engine.input_processor
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            from pagedllm.entrypoints.openai.chat_tools import offline_tool_chat

            if ip.tokenizer is None:
                raise ValueError("tools: chat needs a tokenizer (skip_tokenizer_init is set)")
            template = chat_template or getattr(ip.tokenizer, "chat_template", None)
            convs, tool_vars = offline_tool_chat([list(c) for c in convs], tools, template)
            extra.update(tool_vars)
        # Image parts (image_url data URLs, image_pil) become multi_modal_data.
        plist: list[PromptType] = [
            ip.chat_prompt(c, chat_template, add_generation_prompt, **extra) for c in convs]
        return self._run(plist, sampling_params, use_tqdm, None)

    def _run(self, plist: list[PromptType], sampling_params: Any, use_tqdm: bool,
             priority: Sequence[int] | None, lora_request: Any = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params: got {len(params)} for {len(plist)} "
                                 "prompts; pass one, or one per prompt")
        prio = list(priority) if priority is not None else [0] * len(plist)
        if len(prio) != len(plist):
            raise ValueError("priority: pass one value per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(plist)
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, str):
            loras = list(lora_request)
            if len(loras) != len(plist):
                raise ValueError(f"lora_request: got {len(loras)} for {len(plist)} "
                                 "prompts; pass one, or one per prompt")
        else:
            raise ValueError(f"lora_request must be a LoRARequest or a list of them, got "
                             f"{type(lora_request).__name__}")
        engine = self.llm_engine
        # Validate everything first: a bad prompt must not leave others half-queued.
        rids = [str(next(self._counter)) for _ in plist]
        processed = [engine.input_processor.process(rid, p, sp, priority=pr,
                                                    lora_request=lr)
                     for rid, p, sp, pr, lr in zip(rids, plist, params, prio, loras)]
        return self._run_to_completion(rids, processed, use_tqdm)

    def _run_to_completion(self, rids: list[str], processed: Sequence[Any],
                           use_tqdm: bool) -> list[Any]:
        """Queue already validated requests (``rids[i]`` with ``processed[i]``), step the
        engine until all finish, and return their final outputs in ``rids`` order.  On
        any exception (Ctrl-C included) the queued ones are aborted."""
        engine = self.llm_engine
        ids_in_order: list[str] = []
        finished: dict[str, Any] = {}
        try:
            for rid, proc in zip(rids, processed):
                engine.add_processed(rid, proc)
                ids_in_order.append(rid)
            with tqdm(total=len(rids), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids_in_order)
            raise
        return [finished[r] for r in ids_in_order]


def _shutdown_engine(box: list[LLMEngine]) -> None:
    """``LLM.shutdown``, and the ``LLM``'s finalizer: holds no reference to the ``LLM``.
    ``LLMEngine.shutdown`` frees the weights, KV cache and graphs; the collection after it
    takes the engine's own remaining cycles (the heap is unfrozen by then)."""
    if not box:
        return
    engine = box.pop()
    try:
        engine.shutdown()
    finally:
        del engine
        gc.collect()
