"""The synchronous engine behind the offline ``LLM``: input processor -> core -> output
processor, with the core in this process (``InprocClient``)."""

from __future__ import annotations

import logging
import sys

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    PromptType,
    load_tokenizer,
)
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.gc_heap import freeze_gc_heap, release_gc_heap
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, max_logprobs: int = 20) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.client = InprocClient(config)
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, self.client.max_tokens_per_request,
            max_logprobs, config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The same Prometheus series a server exports, on a registry of this engine's
        # own (no process collectors): ``LLM.get_metrics()`` reads them.
        self.metrics = EngineMetrics(
            config.model_config.served_model_name, max_model_len=config.model_config.max_model_len,
            process_collectors=False,
            speculative=config.scheduler_config.speculative_config is not None)
        # The core runs in this process: keep its start-up heap out of full collections.
        freeze_gc_heap("LLM engine")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        """Validate and queue a request (ValueError names the bad parameter; nothing is
        queued then)."""
        self.add_processed(request_id, self.input_processor.process(
            request_id, prompt, params, arrival_time, priority), kind)

    def add_processed(self, request_id: str, processed: ProcessedRequest,
                      kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        """Queue a request already validated by ``input_processor.process``."""
        text, ids, params, core_reqs = processed
        self.output_processor.add_request(request_id, text, ids, params,
                                          core_reqs[0].arrival_time, kind)
        added: list[str] = []
        try:
            for r in core_reqs:
                self.client.add_request(r)
                added.append(r.request_id)
                self.metrics.add_request(r)
        except ValueError:
            self.metrics.on_finished(added, "abort")
            self.client.abort_requests(added)
            self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            ids = self.output_processor.abort_request(rid)
            self.metrics.on_finished(ids, "abort")
            self.client.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests run."""
        return self.client.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        core_out = self.client.get_output()
        self.metrics.on_outputs(core_out)
        processed = self.output_processor.process_outputs(core_out)
        if processed.reqs_to_abort:  # stop strings found here
            self.metrics.on_finished(processed.reqs_to_abort, "stop")
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def shutdown(self) -> None:
        """Stop the core (its ranks, threads and worker: weights, KV cache, CUDA graphs
        dropped), then free what they held now (idempotent).  Start-up froze the heap
        (``freeze_gc_heap``), so the model's own reference cycles (weight loaders bound to
        their layers, ...) would outlive it: unfreeze and collect them, then hand the
        freed blocks back to the CUDA driver -- with the cuBLAS workspaces the engine's
        GEMMs (one per stream they ran on, CUDA-graph capture's included) left in torch's
        caching allocator."""
        self.client.shutdown()
        release_gc_heap()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
