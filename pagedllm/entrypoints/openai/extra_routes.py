"""Routes beyond OpenAI's completions and chat: the Anthropic Messages API
(``serving_messages.py``) and the OpenAI Responses API (``serving_responses.py``).

Bodies are read as JSON here (not pydantic models): each API translates its own
request and names the bad field in its own error envelope."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.json_body import loads_strict
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.serving_base import ServingState
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_messages import (
    AnthropicServingMessages,
    anthropic_error,
)
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses


async def _json_body(raw_request: Request) -> Any:
    return loads_strict(await raw_request.body())  # 400 naming the field (json_body.py)


def add_extra_routes(app: FastAPI, state: ServingState, chat: OpenAIServingChat) -> None:
    messages = AnthropicServingMessages(chat)
    responses = OpenAIServingResponses(chat)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        """Anthropic Messages API (streaming with Anthropic's events)."""
        try:
            body = await _json_body(raw_request)
        except RequestError as e:
            return anthropic_error(e)
        return await messages.create(body, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw_request: Request) -> Response:
        """Anthropic: the prompt's token count, ``{"input_tokens": N}``."""
        try:
            body = await _json_body(raw_request)
        except RequestError as e:
            return anthropic_error(e)
        return await messages.count_tokens(body, raw_request)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        """OpenAI Responses API (``previous_response_id`` from an in-memory store)."""
        try:
            body = await _json_body(raw_request)
        except RequestError as e:
            return error_response(e.message, param=e.param)
        return await responses.create(body, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return responses.get(response_id)
