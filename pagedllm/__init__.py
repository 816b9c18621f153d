"""pagedllm: a readable paged-KV-cache LLM inference and serving engine."""

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "LoRARequest", "SamplingParams", "RequestOutput",
           "CompletionOutput",
           "Logprob", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for SamplingParams in the API server) must not
    # pull in torch and the model code.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
