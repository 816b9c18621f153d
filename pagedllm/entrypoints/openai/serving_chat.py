"""``POST /v1/chat/completions``: messages rendered with the chat template,
``max_completion_tokens``, logprobs/top_logprobs, n, and streaming deltas with the role
first (one ``{"role": "assistant", "content": ""}`` chunk per choice, then content).

A per-request ``chat_template`` is refused unless the operator started the server with
``--trust-request-chat-template``: templates are code (Jinja); an allowed one renders in
a separate process bounded in time, memory and output size (``template_sandbox``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai.chat_images import (
    chat_prompt_ids,
    image_refs,
    intake,
    template_messages_with_images,
    with_pil_images,
)
from pagedllm.entrypoints.openai.chat_tools import ChoiceShaper, ToolMode, function_tools
from pagedllm.entrypoints.openai.json_body import check_depth
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from pagedllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    ServingHandler,
    engine_error_response,
    logprob_value,
    merge_streams,
    sse,
    sse_error,
    token_text,
    usage,
    with_cancellation,
)
from pagedllm.entrypoints.openai.template_sandbox import check_template_kwargs
from pagedllm.entrypoints.openai.tool_prompt import fallback_messages
from pagedllm.outputs import CompletionOutput


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    role_sent: bool = False
    # Tools and reasoning: how the text becomes the message (chat_tools.py).
    shaper: ChoiceShaper = field(default_factory=ChoiceShaper)

    def absorb(self, c: CompletionOutput) -> None:
        """Add one streamed delta of this choice."""
        self.text += c.text
        self.num_tokens += len(c.token_ids)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class OpenAIServingChat(ServingHandler):
    async def render(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of ``body.messages`` (400 on template errors)."""
        return list((await self.render_prompt(body))["prompt_token_ids"])

    async def render_prompt(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """The engine prompt of ``body.messages``: ``{"prompt_token_ids": [...]}``,
        with ``"multi_modal_data": {"image": [...]}`` when the messages hold images
        (``chat_images``: checked, then loaded, before the template renders; 400 naming
        the part).

        Rendering and tokenising run off the event loop: the server's own template in a
        worker thread, a request's own template in the sandbox process
        (``template_sandbox``), so big or hostile inputs never stall other requests."""
        st = self.state
        if body.chat_template is not None and not st.trust_request_chat_template:
            raise RequestError("chat_template in a request is not allowed on this server "
                               "(start it with --trust-request-chat-template)",
                               "chat_template")
        extra = check_template_kwargs(body.chat_template_kwargs)
        refs = image_refs(body.messages)
        images: list[Any] = []
        if refs:
            images_in = intake(st)
            images_in.check(refs, st.model_name)
            images = await images_in.load(refs)
        ip = st.engine.input_processor
        messages = template_messages(body, images=bool(refs))
        if body.chat_template is not None:
            special = dict(getattr(self.tokenizer, "special_tokens_map", None) or {})
            text = await st.sandbox().render(
                body.chat_template,
                # As apply_chat_template does: keys whose value is None are dropped.
                [{k: v for k, v in m.items() if v is not None} for m in messages],
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                kwargs={**special, **extra})
            if images:  # the model's processor expands each image's placeholder
                ids, _ = await st.off_loop(ip.mm.process, text, images,
                                           add_special_tokens=False)
            else:
                ids = await st.off_loop(ip.encode_text, text)
        else:
            if body.continue_final_message:
                extra["continue_final_message"] = True
            if st.tool_prompt_fallback:  # the template has no tools: the system prompt
                # (shown for tool_choice "none" too, as a template shows them)
                messages = fallback_messages(messages, function_tools(body.tools))
            elif body.tools:
                extra["tools"] = body.tools
            if images:  # as offline LLM.chat: template, then the model's processor
                ids = await st.off_loop(
                    chat_prompt_ids, ip, with_pil_images(messages, images),
                    chat_template=st.chat_template,
                    add_generation_prompt=body.add_generation_prompt, **extra)
            else:
                ids = await st.off_loop(
                    ip.apply_chat_template, messages, chat_template=st.chat_template,
                    add_generation_prompt=body.add_generation_prompt, **extra)
        if body.add_special_tokens and self.tokenizer is not None:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        st = self.state
        try:
            st.check_unknown(body)
            st.check_model(body.model)
            body.validate_request(st.max_n, st.max_logprobs)
            params = body.to_sampling_params(st.vocab_size)
            mode, params = chat_extensions(st, body, params)
            st.check_admitting()
            public_id = st.public_id(raw_request, "chatcmpl", body.request_id)
            prompt = await self.render_prompt(body)
            prompt_ids = prompt["prompt_token_ids"]
            streams = await st.start(public_id, [prompt], params,
                                     body.priority, model=body.model,
                                     raw_request=raw_request)
        except Exception as e:
            if isinstance(e, ValueError) and not isinstance(e, RequestError) \
                    and str(e).startswith("messages"):  # a RequestError names its field
                e = RequestError(str(e).splitlines()[0], "messages")
            return engine_error_response(e)
        created = int(time.time())
        model = body.model or st.model_name
        if body.stream:
            return StreamingResponse(
                self._stream(body, public_id, streams[0], params.n, created, model,
                             len(prompt_ids), mode),
                media_type="text/event-stream")
        return await with_cancellation(raw_request, lambda: self._full(
            body, public_id, streams[0], params.n, created, model, len(prompt_ids), mode))

    def _choices(self, n: int, mode: ToolMode) -> list[_Choice]:
        st = self.state
        return [_Choice(shaper=ChoiceShaper(mode, st.tool_parser_obj(),
                                            st.reasoning_parser_obj(),
                                            incremental_tools=True))
                for _ in range(n)]

    # ------------------------------------------------------------------ conversion

    def _logprobs(self, body: ChatCompletionRequest, c: CompletionOutput
                  ) -> dict[str, Any] | None:
        if not body.logprobs or c.logprobs is None:
            return None
        num_top = body.top_logprobs or 0
        content = []
        for tid, lps in zip(c.token_ids, c.logprobs):
            chosen = lps.get(tid)
            text = token_text(chosen, tid, self.tokenizer) if chosen else str(tid)
            # Ranks are unique (the chosen token keeps its true rank; see OutputProcessor).
            top = sorted((lp.rank, t, lp) for t, lp in lps.items()
                         if lp.rank is not None and lp.rank <= num_top)
            top_list = []
            for _, t, lp in top:
                ttext = token_text(lp, t, self.tokenizer)
                top_list.append({"token": ttext, "logprob": logprob_value(lp.logprob),
                                 "bytes": list(ttext.encode())})
            content.append({
                "token": text,
                "logprob": logprob_value(chosen.logprob) if chosen else -9999.0,
                "bytes": list(text.encode()), "top_logprobs": top_list[:num_top]})
        return {"content": content}

    # ------------------------------------------------------------------ non-streaming

    async def _full(self, body: ChatCompletionRequest, public_id: str,
                    stream: RequestStream, n: int, created: int, model: str,
                    num_prompt: int, mode: ToolMode) -> Response:
        choices = self._choices(n, mode)
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        try:
            async for _, out in merge_streams([stream]):
                for c in out.outputs:
                    ch = choices[c.index]
                    if ch.finish_reason is not None:
                        continue
                    ch.absorb(c)
                    lp = self._logprobs(body, c)
                    if lp is not None:
                        logprobs[c.index].extend(lp["content"])
        except Exception as e:
            return engine_error_response(e)
        finally:
            self.state.finish(public_id, [stream])
        messages = [ch.shaper.message(ch.text) if not ch.shaper.plain
                    else ({"role": "assistant", "content": ch.text}, False)
                    for ch in choices]
        return JSONResponse({
            "id": public_id, "object": "chat.completion", "created": created,
            "model": model,
            "choices": [{
                "index": i, "message": messages[i][0],
                "logprobs": {"content": logprobs[i]} if body.logprobs else None,
                "finish_reason": _finish_reason(ch, messages[i][1], mode),
                "stop_reason": ch.stop_reason,
            } for i, ch in enumerate(choices)],
            "usage": _usage(num_prompt, choices),
        })

    # ------------------------------------------------------------------ streaming

    async def _stream(self, body: ChatCompletionRequest, public_id: str,
                      stream: RequestStream, n: int, created: int, model: str,
                      num_prompt: int, mode: ToolMode) -> AsyncIterator[bytes]:
        choices = self._choices(n, mode)
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)

        def chunk(choice: dict[str, Any]) -> bytes:
            d: dict[str, Any] = {"id": public_id, "object": "chat.completion.chunk",
                                 "created": created, "model": model, "choices": [choice]}
            if include_usage:
                d["usage"] = _usage(num_prompt, choices) if continuous else None
            return sse(d)

        try:
            # The role comes first, for every choice, before any content (OpenAI order).
            for i, ch in enumerate(choices):
                ch.role_sent = True
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            async for _, out in merge_streams([stream]):
                for c in out.outputs:
                    ch = choices[c.index]
                    if ch.finish_reason is not None:
                        continue
                    ch.absorb(c)
                    if not c.text and not c.token_ids and ch.finish_reason is None:
                        continue
                    done = ch.finish_reason is not None
                    if ch.shaper.plain:
                        delta, calls = ({"content": c.text} if c.text else {}), False
                    else:
                        delta, calls = ch.shaper.delta(c.text, final=done)
                        if not delta and not done and not body.logprobs:
                            continue  # held back (a marker may be starting)
                    yield chunk({"index": c.index, "delta": delta,
                                 "logprobs": self._logprobs(body, c),
                                 "finish_reason": _finish_reason(ch, calls, mode)
                                 if done else None,
                                 "stop_reason": ch.stop_reason})
            if include_usage:
                yield sse({"id": public_id, "object": "chat.completion.chunk",
                           "created": created, "model": model, "choices": [],
                           "usage": _usage(num_prompt, choices)})
        except Exception as e:
            yield sse_error(e)
        finally:
            self.state.finish(public_id, [stream])
        yield SSE_DONE


def _finish_reason(ch: _Choice, has_calls: bool, mode: ToolMode) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call (auto, required); a named
    # tool_choice finishes with "stop".
    if has_calls and ch.finish_reason == "stop" and mode.kind in ("auto", "required"):
        return "tool_calls"
    return ch.finish_reason


def template_messages(body: ChatCompletionRequest, images: bool = False
                      ) -> list[dict[str, Any]]:
    """The messages for the template; assistant ``tool_calls`` arguments decoded from
    their JSON strings (chat templates print them as objects).  Nesting is bounded
    before parsing (400 naming the field: 100,000 levels were a ``RecursionError``);
    text that is not JSON stays a string.  With ``images``, a message holding images
    keeps its parts, ``{"type": "image"}`` where each image was."""
    out = (template_messages_with_images(body.messages) if images
           else body.template_messages())
    for i, m in enumerate(out):
        calls = m.get("tool_calls")
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                check_depth(fn["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
    return out


def chat_extensions(st: Any, body: ChatCompletionRequest, params: Any) -> tuple[ToolMode,
                                                                           Any]:
    """The request's tool mode, and its params with the tool grammar (required or
    named tool choice) and the reasoning end marker applied."""
    from dataclasses import asdict

    from pagedllm.entrypoints.openai.chat_tools import reasoning_end_ids, tool_mode

    mode = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls,
                     st.enable_auto_tool_choice and st.tool_call_parser is not None,
                     fallback=st.tool_prompt_fallback)
    changes: dict[str, Any] = {}
    so = params.structured_outputs
    if mode.kind == "auto" and mode.constraint is not None and so is not None:
        mode = replace(mode, constraint=None)  # the client's format wins
    if mode.constraint is not None:
        if so is not None:
            raise RequestError("tool_choice \"required\" or a named function cannot be "
                               "combined with response_format or structured_outputs",
                               "tool_choice")
        so = mode.constraint
    parser = st.tool_parser_obj()
    if mode.kind == "auto" and parser is not None and parser.needs_special_tokens:
        changes["skip_special_tokens"] = False
    if so is not None and st.reasoning_parser is not None:
        d = asdict(so)
        d["reasoning_end_token_ids"] = reasoning_end_ids(st.engine.tokenizer)
        changes["structured_outputs"] = d
    elif so is not params.structured_outputs:
        changes["structured_outputs"] = asdict(so)
    return mode, (params.clone(**changes) if changes else params)


def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict[str, int]:
    return usage(prompt_tokens, sum(ch.num_tokens for ch in choices))
