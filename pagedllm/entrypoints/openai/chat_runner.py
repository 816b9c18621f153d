"""Run one chat request for the non-OpenAI-chat APIs (``/v1/messages``,
``/v1/responses``): they translate their request into a ``ChatCompletionRequest`` (so
every check, the chat template, tools, grammars and reasoning are the chat endpoint's)
and read the generation back as text deltas and a final message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai.chat_tools import ChoiceShaper, ToolMode
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, chat_extensions


@dataclass
class ChatRun:
    """A started generation (one choice)."""

    chat: OpenAIServingChat
    public_id: str
    stream: RequestStream
    num_prompt_tokens: int
    shaper: ChoiceShaper
    mode: ToolMode
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    calls_seen: list[dict[str, Any]] = field(default_factory=list)

    async def deltas(self) -> AsyncIterator[dict[str, Any]]:
        """Deltas in the chat shape (``content``, ``reasoning_content``,
        ``tool_calls``); the run's totals are updated as they come."""
        try:
            async for out in self.stream:
                for c in out.outputs:
                    self.text += c.text
                    self.num_tokens += len(c.token_ids)
                    done = c.finish_reason is not None
                    if done:
                        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
                    d, _ = self.shaper.delta(c.text, final=done)
                    if d:
                        yield d
        finally:
            self.chat.state.finish(self.public_id, [self.stream])

    async def run(self) -> dict[str, Any]:
        """Wait for the end; the final assistant message (chat shape)."""
        async for _ in self.deltas():
            pass
        return self.shaper.message(self.text)[0]

    def close(self) -> None:
        self.chat.state.finish(self.public_id, [self.stream])


async def start_chat(chat: OpenAIServingChat, body: ChatCompletionRequest,
                     raw_request: Request, prefix: str) -> ChatRun:
    """Validate, render and start ``body`` (``RequestError`` and engine errors raise)."""
    st = chat.state
    st.check_model(body.model)
    body.validate_request(st.max_n, st.max_logprobs)
    if (body.n or 1) != 1:
        raise RequestError("n must be 1 on this endpoint", "n")
    params = body.to_sampling_params(st.vocab_size)
    mode, params = chat_extensions(st, body, params)
    st.check_admitting()
    public_id = st.public_id(raw_request, prefix, body.request_id)
    try:
        prompt = await chat.render_prompt(body)
    except ValueError as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(str(e).splitlines()[0], "messages") from None
    ids = prompt["prompt_token_ids"]
    [stream] = await st.start(public_id, [prompt], params,
                              body.priority, model=body.model, raw_request=raw_request)
    shaper = ChoiceShaper(mode, st.tool_parser_obj(), st.reasoning_parser_obj())
    return ChatRun(chat, public_id, stream, len(ids), shaper, mode)
