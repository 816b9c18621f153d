"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request is translated into a chat request (``chat_runner``): ``system`` (a string or
text blocks) becomes a system message; ``text``, ``tool_use`` and ``tool_result``
blocks become chat content, assistant ``tool_calls`` and ``tool`` messages;
``stop_sequences`` are stop strings; ``tools`` (``input_schema``) become functions and
``tool_choice`` ``auto``/``any``/``tool``/``none`` maps to ``auto``/``required``/a
named function/``none``.  The answer is a ``message`` with ``text`` and ``tool_use``
blocks and Anthropic's ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence``, ``tool_use``).  Streaming sends Anthropic's events:
``message_start``, ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``content_block_stop``, ``message_delta`` (stop reason and
usage), ``message_stop``.  Errors use Anthropic's envelope
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.chat_images import anthropic_image_part
from pagedllm.entrypoints.openai.chat_runner import ChatRun, start_chat
from pagedllm.entrypoints.openai.json_body import loads_strict
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from pagedllm.entrypoints.openai.serving_base import engine_error_response
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}
_KNOWN = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "tools", "tool_choice", "metadata", "thinking",
          "service_tier"}


def anthropic_error(e: BaseException) -> JSONResponse:
    """Any error as Anthropic's envelope, same status as the OpenAI routes."""
    resp = engine_error_response(e)
    body = json.loads(bytes(resp.body))
    err = body.get("error", {})
    return JSONResponse(
        {"type": "error", "error": {
            "type": _ERROR_TYPES.get(resp.status_code, "api_error"),
            "message": err.get("message", "error"), "param": err.get("param")}},
        status_code=resp.status_code, headers={
            k: v for k, v in resp.headers.items() if k.lower() == "retry-after"})


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of blocks", "messages")
    parts = []
    for b in content:
        if not isinstance(b, dict) or b.get("type") != "text":
            raise RequestError(f"{where}: only text blocks are supported here", "messages")
        parts.append(str(b.get("text", "")))
    return "".join(parts)


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError("messages: each message needs role 'user' or 'assistant'",
                               "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError("messages: content must be a string or a list of blocks",
                               "messages")
        text, calls, parts = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
                parts.append({"type": "text", "text": text[-1]})
            elif kind == "image":  # chat_images: a data: or http(s) image_url part
                parts.append(anthropic_image_part(b, f"messages.{i}.content.{j}"))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": b.get("id"), "type": "function", "function": {
                    "name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(b.get("content", ""), "tool_result")})
            else:
                raise RequestError(f"messages: content blocks of type {kind!r} are not "
                                   "supported", "messages")
        if text or calls or parts:
            msg: dict[str, Any] = {"role": m["role"], "content": (
                parts if len(parts) > len(text) else "".join(text))}  # images: parts
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None:
        return None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise RequestError("tool_choice must be {\"type\": auto|any|tool|none}", "tool_choice")


def to_chat_request(body: dict[str, Any], stream: bool = False) -> ChatCompletionRequest:
    """The chat request an Anthropic request means (400 naming the field)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise RequestError(f"Unrecognized request argument(s): {', '.join(unknown)}",
                           unknown[0])
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int):
        raise RequestError("max_tokens is required (an integer >= 1)", "max_tokens")
    tools = None
    if body.get("tools"):
        if not isinstance(body["tools"], list):
            raise RequestError("tools must be a list", "tools")
        tools = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object"}}}
            for t in body["tools"] if isinstance(t, dict)]
    fields: dict[str, Any] = {
        "model": body.get("model"), "messages": _chat_messages(body), "max_tokens": mt,
        "stop": body.get("stop_sequences"), "stream": stream, "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice"))}
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            fields[k] = body[k]
    try:
        return ChatCompletionRequest.model_validate(fields)
    except Exception as e:  # pydantic ValidationError: name the first field
        errs = getattr(e, "errors", lambda: [])()
        loc = errs[0]["loc"][0] if errs and errs[0].get("loc") else None
        msg = errs[0]["msg"] if errs else "invalid request"
        raise RequestError(f"{loc}: {msg}" if loc else msg,
                           str(loc) if loc is not None else None) from None


def _stop_reason(run: ChatRun, has_calls: bool) -> tuple[str, str | None]:
    if has_calls and run.finish_reason == "stop":
        return "tool_use", None
    if run.finish_reason == "length":
        return "max_tokens", None
    if isinstance(run.stop_reason, str):
        return "stop_sequence", run.stop_reason
    return "end_turn", None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's ``arguments`` as Anthropic's ``tool_use.input``, which must be an object:
    the arguments when they are a JSON object; anything else a tool parser may return
    (a JSON string or number, text that is not JSON, JSON nested too deeply) is wrapped
    as ``{"value": ...}`` (the decoded value, or the text itself), never a 500."""
    if isinstance(arguments, dict):
        return arguments
    value = arguments
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            value = loads_strict(arguments)
        except RequestError:
            value = arguments
    return value if isinstance(value, dict) else {"value": value}


def _input_json(arguments: Any) -> str:
    """The streamed ``partial_json`` of a call: the model's own text when it is the
    ``input`` object already, else that object written out (as ``_blocks`` has it)."""
    inp = tool_input(arguments)
    if isinstance(arguments, str):
        try:
            if loads_strict(arguments) == inp:
                return arguments
        except RequestError:
            pass
    return json.dumps(inp, ensure_ascii=False)


def _blocks(msg: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": c["id"].replace("call_", "toolu_", 1),
                       "name": c["function"]["name"],
                       "input": tool_input(c["function"]["arguments"])})
    return blocks


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, body: Any, raw_request: Request) -> Response:
        try:
            stream = bool(body.get("stream")) if isinstance(body, dict) else False
            req = to_chat_request(body, stream)
            run = await start_chat(self.chat, req, raw_request, "msg")
        except Exception as e:
            return anthropic_error(e)
        model = req.model or self.chat.state.model_name
        if stream:
            return StreamingResponse(self._stream(run, model),
                                     media_type="text/event-stream")
        try:
            msg = await run.run()
        except Exception as e:
            return anthropic_error(e)
        stop, seq = _stop_reason(run, bool(msg.get("tool_calls")))
        return JSONResponse({
            "id": run.public_id, "type": "message", "role": "assistant", "model": model,
            "content": _blocks(msg), "stop_reason": stop, "stop_sequence": seq,
            "usage": {"input_tokens": run.num_prompt_tokens,
                      "output_tokens": run.num_tokens}})

    async def _stream(self, run: ChatRun, model: str) -> AsyncIterator[bytes]:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": run.public_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": run.num_prompt_tokens, "output_tokens": 0}}})
        index, text_open, has_calls = 0, False, False
        try:
            async for d in run.deltas():
                if d.get("content"):
                    if not text_open:
                        yield _event("content_block_start", {
                            "type": "content_block_start", "index": index,
                            "content_block": {"type": "text", "text": ""}})
                        text_open = True
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": d["content"]}})
                for c in d.get("tool_calls") or []:
                    if text_open:
                        yield _event("content_block_stop", {"type": "content_block_stop",
                                                            "index": index})
                        index, text_open = index + 1, False
                    has_calls = True
                    yield _event("content_block_start", {
                        "type": "content_block_start", "index": index, "content_block": {
                            "type": "tool_use",
                            "id": c["id"].replace("call_", "toolu_", 1),
                            "name": c["function"]["name"], "input": {}}})
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta",
                            "partial_json": _input_json(c["function"]["arguments"])}})
                    yield _event("content_block_stop", {"type": "content_block_stop",
                                                        "index": index})
                    index += 1
        except Exception as e:
            resp = anthropic_error(e)
            yield _event("error", json.loads(bytes(resp.body)))
            return
        if text_open:
            yield _event("content_block_stop", {"type": "content_block_stop",
                                                "index": index})
        stop, seq = _stop_reason(run, has_calls)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop, "stop_sequence": seq},
                                       "usage": {"output_tokens": run.num_tokens}})
        yield _event("message_stop", {"type": "message_stop"})

    async def count_tokens(self, body: Any, raw_request: Request) -> Response:
        try:
            if isinstance(body, dict):
                body = {**body, "max_tokens": 1}
                body.pop("stream", None)
            req = to_chat_request(body)
            self.chat.state.check_model(req.model)
            ids = await self.chat.render(req)
        except Exception as e:
            if isinstance(e, ValueError) and not isinstance(e, RequestError):
                e = RequestError(str(e).splitlines()[0], "messages")
            return anthropic_error(e)
        return JSONResponse({"input_tokens": len(ids)})
