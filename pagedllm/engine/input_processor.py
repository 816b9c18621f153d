"""Turn user prompts into validated ``EngineCoreRequest``s (tokenise, check, fan out n).

Every rejection is a ``ValueError`` whose message names the offending parameter; the
server maps ``ContextLengthError`` to ``code: context_length_exceeded``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.config import EngineConfig, LoRAConfig, ModelConfig
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.messages import EngineCoreRequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.parse import images_of, split_chat_images
from pagedllm.multimodal.processor import MultiModalProcessor
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | Sequence[int] | Mapping[str, Any]
# (prompt text or None, prompt token ids, effective params, the core requests: one, whose
# ``fork_ids`` name sequences 1..n-1 when n > 1)
ProcessedRequest = tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]


def load_tokenizer(config: EngineConfig) -> Any | None:
    mc = config.model_config
    if mc.skip_tokenizer_init:
        return None
    return mc.resolved.load_tokenizer(mc.trust_remote_code)


def normalise_prompts(prompts: Any) -> list[PromptType]:
    """One prompt (text, token ids, dict) or a list of them -> a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if len(prompts) == 0:
            raise ValueError("prompts must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, or a list of these; "
                     f"got {type(prompts).__name__}")


class ContextLengthError(ValueError):
    """The prompt (plus ``max_tokens``) does not fit ``max_model_len``."""

    def __init__(self, message: str, param: str, prompt_tokens: int, max_model_len: int):
        super().__init__(message)
        self.param = param
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 max_tokens_per_request: int | None = None, max_logprobs: int = 20,
                 lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.loras = LoRARegistry(lora_config, model_config.hf_config)
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.max_tokens_per_request = max_tokens_per_request or self.max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = model_config.vocab_size
        # Whether process() parses and checks grammars itself (offline); the server
        # turns it off: its grammar-check workers have done it off the event loop
        # (structured_output/checker.py), and only the cheap size bounds run here.
        self.check_grammars = True
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        cfg_eos = getattr(model_config.hf_config, "eos_token_id", None)
        cfg_eos_list = cfg_eos if isinstance(cfg_eos, list) else (
            [cfg_eos] if cfg_eos is not None else [])
        self.eos_token_id: int | None = eos if eos is not None else (
            cfg_eos_list[0] if cfg_eos_list else None)
        # Extra end-of-sequence ids (e.g. Llama 3's <|eot_id|>) stop like stop_token_ids.
        self.extra_eos_ids = [t for t in cfg_eos_list if t != self.eos_token_id]
        # Vision-language models: the model's own processor (multimodal/processor.py).
        mm = getattr(model_config, "multimodal_config", None)
        self.mm_limits: dict[str, int] = dict(mm.limit_per_prompt) if mm else {}
        self.mm: MultiModalProcessor | None = MultiModalProcessor(
            model_config.resolved.directory, model_config.hf_config,
            model_config.trust_remote_code) if mm is not None else None

    # -- prompts -------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids); ValueError naming ``prompt``."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer "
                                 "(skip_tokenizer_init is set); pass token ids")
            return prompt, self.encode_text(prompt, add_special_tokens=True)
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")

    def tokenize_multimodal(self, prompt: PromptType,
                            ) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """``tokenize`` plus a dict prompt's ``multi_modal_data`` (vLLM's shape): the
        model's processor expands each image's placeholder tokens in the prompt text, or
        finds the runs already expanded in ``prompt_token_ids``.  ``ValueError`` naming
        ``multi_modal_data`` (text-only model, bad images) or ``limit_mm_per_prompt``.
        A text prompt with images is tokenised by the processor, with special tokens
        unless the dict says ``"add_special_tokens": False`` (text a template rendered)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if data is None:
            return (*self.tokenize(prompt), [])
        assert isinstance(prompt, Mapping)
        if self.mm is None:
            raise ValueError(f"multi_modal_data: {self.model_config.served_model_name} is "
                             "a text-only model; it takes no images")
        images = images_of(data)
        limit = self.mm_limits.get("image", 0)
        if len(images) > limit:
            raise ValueError(f"limit_mm_per_prompt: the prompt has {len(images)} images, "
                             f"more than the limit of {limit} per prompt")
        if not images:
            return (*self.tokenize({k: v for k, v in prompt.items()
                                    if k != "multi_modal_data"}), [])
        if "prompt_token_ids" in prompt:
            ids, feats = self.mm.process(self._check_ids(prompt["prompt_token_ids"]),
                                         images)
            return prompt.get("prompt"), ids, feats
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        ids, feats = self.mm.process(text, images,
                                     bool(prompt.get("add_special_tokens", True)))
        return text, self._check_ids(ids), feats

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    chat_template: str | None = None, add_generation_prompt: bool = True,
                    **kwargs: Any) -> PromptType:
        """One conversation as a prompt for ``process``: ``{"prompt_token_ids": ids}``,
        and with images (OpenAI ``image_url`` data-URL parts, ``image_pil`` parts) the
        images as ``multi_modal_data``, their placeholder runs expanded in ``ids`` (the
        server's chat endpoint reads ``prompt_token_ids`` too)."""
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list")
        msgs, images = split_chat_images(messages)
        if not images:
            return {"prompt_token_ids": self.apply_chat_template(
                messages, chat_template, add_generation_prompt, **kwargs)}
        if self.mm is None:
            raise ValueError(f"messages: {self.model_config.served_model_name} is a "
                             "text-only model; it takes no images")
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init is set)")
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja errors, missing template, bad roles
            raise ValueError(f"messages: cannot apply the chat template: {e}") from e
        limit = self.mm_limits.get("image", 0)
        if len(images) > limit:
            raise ValueError(f"limit_mm_per_prompt: the conversation has {len(images)} "
                             f"images, more than the limit of {limit} per prompt")
        # The template wrote the special tokens; the processor adds none.
        ids, _ = self.mm.process(text, images, add_special_tokens=False)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise ValueError("prompt_token_ids must be a list of integers")
        if len(ids) == 0:
            raise ValueError("prompt must not be empty")
        # Fast path: plain ints (``type is int`` also rules out bools) in range are
        # checked by C-level builtins; anything else takes the loop below, which names
        # the offending id.
        if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < self.vocab_size:
            return list(ids)
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt token ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t} is out of vocabulary (must be in [0, "
                    f"{self.vocab_size}))")
            out.append(t)
        return out

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """Render ``messages`` with the model's (or the given) chat template."""
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init is set)")
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja errors, missing template, bad roles
            raise ValueError(f"messages: cannot apply the chat template: {e}") from e
        return self.encode_text(text)

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``ValueError`` naming ``prompt`` if the tokenizer
        refuses it (e.g. text that is not valid Unicode).  Thread-safe: the server calls
        it from worker threads so big prompts do not stall its event loop."""
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer "
                             "(skip_tokenizer_init is set); pass token ids")
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)
                        .input_ids)
        except (UnicodeError, TypeError, ValueError) as e:
            raise ValueError(f"prompt: the tokenizer cannot encode it "
                             f"({type(e).__name__})") from None

    # -- requests ------------------------------------------------------------------
    def check_params(self, num_prompt: int, params: SamplingParams) -> SamplingParams:
        """Validate against the model and fill defaults; returns the params to use."""
        mml = self.max_model_len
        if num_prompt >= mml:
            raise ContextLengthError(
                f"This model's maximum context length is {mml} tokens, but the prompt "
                f"has {num_prompt} tokens", "prompt", num_prompt, mml)
        changes: dict[str, Any] = {}
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(mml, self.max_tokens_per_request) - num_prompt
            changes["max_tokens"] = max_tokens
            if params.min_tokens > max_tokens:
                # Not clamped: a min_tokens that cannot be met is a client error (clamping
                # 1e30 forced a whole-context generation).
                raise ContextLengthError(
                    f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens "
                    f"left in the context (maximum context length {mml}, the prompt has "
                    f"{num_prompt} tokens)", "min_tokens", num_prompt, mml)
        elif num_prompt + max_tokens > mml:
            raise ContextLengthError(
                f"This model's maximum context length is {mml} tokens; the prompt has "
                f"{num_prompt} tokens and max_tokens is {max_tokens} "
                f"({num_prompt + max_tokens} in total)", "max_tokens", num_prompt, mml)
        if num_prompt + max_tokens > self.max_tokens_per_request:
            raise ValueError(
                f"max_tokens: the prompt ({num_prompt}) plus max_tokens ({max_tokens}) "
                f"needs more KV cache than exists ({self.max_tokens_per_request} tokens)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}), "
                                 f"got {v}")
        for tid in list(params.logit_bias or ()) + list(params.stop_token_ids or ()):
            if tid >= self.vocab_size:
                raise ValueError(f"token id {tid} (in logit_bias or stop_token_ids) is out "
                                 f"of vocabulary ({self.vocab_size})")
        changes.update(self._check_constraints(params))
        if self.extra_eos_ids and not params.ignore_eos:
            missing = [t for t in self.extra_eos_ids if t not in (params.stop_token_ids or [])]
            if missing:
                changes["stop_token_ids"] = list(params.stop_token_ids or []) + missing
        return params.clone(**changes) if changes else params

    def _check_constraints(self, params: SamplingParams) -> dict[str, Any]:
        """Structured outputs, bad words and allowed token ids (ValueError naming them);
        returns the changes to make (bad words as token ids)."""
        if params.structured_outputs is not None:
            if self.check_grammars:
                from pagedllm.structured_output.backend import validate

                validate(params.structured_outputs)
            else:
                from pagedllm.structured_output.limits import check_limits

                check_limits(params.structured_outputs)
        for t in params.allowed_token_ids or []:
            if t >= self.vocab_size:
                raise ValueError(f"allowed_token_ids: token id {t} is out of vocabulary "
                                 f"({self.vocab_size})")
        if not params.bad_words or params.bad_words_token_ids is not None:
            return {}
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (skip_tokenizer_init is set)")
        ids: list[list[int]] = []
        for word in params.bad_words:
            # As vLLM: the word alone and after a space (how it appears mid-sentence).
            for text in (word, " " + word.lstrip()):
                tok = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                if tok and tok not in ids:
                    ids.append(tok)
        return {"bad_words_token_ids": ids}

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and tokenise one request (ValueError names the bad parameter)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        pc = self.model_config.pooler_config
        if pc is not None:
            raise ValueError(f"model: {self.model_config.served_model_name} is a pooling "
                             f"model (tasks: {', '.join(pc.tasks)}); it does not generate")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        self.loras.check(lora_request)
        text, ids, mm_features = self.tokenize_multimodal(prompt)
        params = self.check_params(len(ids), params)
        arrival = time.time() if arrival_time is None else arrival_time
        if params.cache_salt is None and isinstance(prompt, Mapping) \
                and prompt.get("cache_salt") is not None:
            params = params.clone(cache_salt=prompt["cache_salt"])
        # n > 1 (samples or beams) is one core request: the core computes the prompt
        # once and forks sequences 1..n-1 (named here) that share its KV blocks.
        if params.n == 1:
            rid, fork_ids = request_id, []
        else:
            rid = child_request_id(request_id, 0)
            fork_ids = [child_request_id(request_id, i) for i in range(1, params.n)]
        children = [EngineCoreRequest(rid, ids, params, arrival, self.eos_token_id,
                                      priority, fork_ids, lora_request=lora_request,
                                      mm_features=mm_features)]
        return text, ids, params, children

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                        arrival_time: float | None = None, priority: int = 0,
                        ) -> ProcessedRequest:
        """Validate and tokenise one pooling request: the whole prompt must fit
        ``max_model_len`` and one step (``ContextLengthError`` naming ``input``), and
        ``params`` the model (``ValueError`` naming the parameter).  The core request
        carries a placeholder ``SamplingParams`` (one step, no text)."""
        if not isinstance(params, PoolingParams):
            raise ValueError("pooling_params must be a PoolingParams")
        mc = self.model_config
        pc = mc.pooler_config
        if pc is None:
            raise ValueError(f"task: {mc.served_model_name} is a generative model (runner "
                             f"'generate'); pooling tasks ({params.task}) need a pooling "
                             "model or runner 'pooling'")
        params.verify(mc.hf_config, int(mc.hf_config.hidden_size), pc.tasks)
        text, ids = self.tokenize(prompt)
        cap = min(self.max_model_len, self.max_tokens_per_request)
        if len(ids) > cap:
            raise ContextLengthError(
                f"input: {len(ids)} tokens is more than the model takes ({cap}: "
                "max_model_len and max_num_batched_tokens)", "input", len(ids), cap)
        if isinstance(prompt, Mapping) and prompt.get("token_type_ids") is not None:
            params = dataclasses.replace(params, token_type_ids=list(prompt["token_type_ids"]))
        if params.token_type_ids is not None and len(params.token_type_ids) != len(ids):
            raise ValueError("token_type_ids must have one entry per input token")
        arrival = time.time() if arrival_time is None else arrival_time
        sp = SamplingParams(max_tokens=1, detokenize=False)
        return text, ids, sp, [EngineCoreRequest(request_id, ids, sp, arrival, None, priority,
                                                 pooling_params=params)]

    def tokenize_pair(self, text_1: str, text_2: str) -> tuple[list[int], list[int] | None]:
        """A cross-encoder's input: ``[CLS] text_1 [SEP] text_2 [SEP]`` (the tokenizer's
        own pair template) and its segment ids (None when the tokenizer has none);
        ``ValueError`` naming ``text``."""
        if self.tokenizer is None:
            raise ValueError("text: scoring text pairs needs a tokenizer "
                             "(skip_tokenizer_init is set)")
        for name, t in (("text_1", text_1), ("text_2", text_2)):
            if not isinstance(t, str) or not t:
                raise ValueError(f"{name} must be a non-empty string")
        enc = self.tokenizer(text_1, text_2)
        types = enc.get("token_type_ids")
        return list(enc["input_ids"]), (list(types) if types is not None else None)
