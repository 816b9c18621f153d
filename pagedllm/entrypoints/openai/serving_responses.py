"""The OpenAI Responses API: ``POST /v1/responses`` (and ``GET /v1/responses/{id}``).

``input`` (a string, or a list of message items ``{"role", "content"}`` with
``input_text`` parts, ``function_call`` and ``function_call_output`` items) and
``instructions`` (a system message) become a chat request (``chat_runner``);
``max_output_tokens``, ``temperature``, ``top_p``, ``tools`` (flat
``{"type": "function", "name", "parameters"}``), ``tool_choice``,
``parallel_tool_calls`` and ``text.format`` (``json_schema`` / ``json_object``) map to
their chat equivalents.  The output is a ``message`` item with ``output_text`` and one
``function_call`` item per tool call; ``status`` is ``incomplete`` (reason
``max_output_tokens``) when the length ran out.

``previous_response_id`` continues a stored conversation: every response with
``store`` (the default) keeps its input and output messages in a bounded in-memory
LRU (:class:`ResponseStore`, ``MAX_STORED`` responses); an unknown id is a 400.

Streaming sends ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` (and the same
added/done pair around each ``function_call``), then ``response.completed``, each with
a ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.chat_images import responses_image_part
from pagedllm.entrypoints.openai.chat_runner import ChatRun, start_chat
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.json_body import check_depth
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from pagedllm.entrypoints.openai.serving_base import engine_error_response
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

MAX_STORED = 1024
# Image URLs (data URLs: the image itself) stored responses may hold in all; the oldest
# go first beyond it, so stored conversations with images cannot fill the memory.
MAX_STORED_IMAGE_BYTES = 256 << 20
_KNOWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "tools", "tool_choice", "parallel_tool_calls", "stream", "previous_response_id",
          "store", "text", "metadata", "user", "reasoning", "truncation", "service_tier",
          "include", "top_logprobs", "background", "prompt_cache_key",
          "safety_identifier"}


class ResponseStore:
    """Bounded LRU of finished responses: id -> (conversation messages, response);
    at most ``max_size`` of them, holding at most ``max_image_bytes`` of image URLs."""

    def __init__(self, max_size: int = MAX_STORED,
                 max_image_bytes: int = MAX_STORED_IMAGE_BYTES) -> None:
        self.max_size = max_size
        self.max_image_bytes = max_image_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = \
            OrderedDict()
        self._image_bytes: dict[str, int] = {}

    def put(self, rid: str, messages: list[dict[str, Any]], resp: dict[str, Any]) -> None:
        self._items[rid] = (messages, resp)
        self._items.move_to_end(rid)
        self._image_bytes[rid] = _image_url_bytes(messages)
        while len(self._items) > self.max_size or (
                len(self._items) > 1
                and sum(self._image_bytes.values()) > self.max_image_bytes):
            old, _ = self._items.popitem(last=False)
            self._image_bytes.pop(old, None)

    def get(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item


def _image_url_bytes(messages: list[dict[str, Any]]) -> int:
    """Characters of the image URLs in chat ``messages`` (a data URL is the image)."""
    n = 0
    for m in messages:
        content = m.get("content")
        for p in content if isinstance(content, list) else ():
            iu = p.get("image_url") if isinstance(p, dict) else None
            url = iu.get("url") if isinstance(iu, dict) else iu
            n += len(url) if isinstance(url, str) else 0
    return n


def _input_messages(inp: Any) -> list[dict[str, Any]]:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for k, item in enumerate(inp):
        if not isinstance(item, dict):
            raise RequestError("input items must be objects", "input")
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                parts: list[Any] = []
                images = False
                for j, p in enumerate(content):
                    kind = p.get("type") if isinstance(p, dict) else None
                    if kind == "input_image":  # chat_images: an image_url part
                        parts.append(responses_image_part(p, f"input.{k}.content.{j}"))
                        images = True
                        continue
                    if kind not in ("input_text", "output_text", "text"):
                        raise RequestError("input: only text and input_image content "
                                           "parts are supported", f"input.{k}.content.{j}")
                    parts.append({"type": "text", "text": str(p.get("text", ""))})
                content = parts if images else "".join(p["text"] for p in parts)
            if not isinstance(content, (str, list)) or item.get("role") not in (
                    "user", "assistant", "system", "developer"):
                raise RequestError("input: a message needs a role and text content",
                                   "input")
            out.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            if isinstance(item.get("arguments"), str):  # parsed for the template later
                check_depth(item["arguments"], f"input.{k}.arguments")
            out.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": str(item.get("output", ""))})
        else:
            raise RequestError(f"input items of type {kind!r} are not supported", "input")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError("tools: only function tools are supported", "tools")
        out.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    return out


def _tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    return {"type": fmt.get("type")}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def _chat_request(self, body: Any, stream: bool
                      ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            raise RequestError(f"Unrecognized request argument(s): {', '.join(unknown)}",
                               unknown[0])
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            stored = self.store.get(prev) if isinstance(prev, str) else None
            if stored is None:
                raise RequestError(f"Previous response with id {prev!r} not found",
                                   "previous_response_id")
            history = [m for m in stored[0] if m["role"] != "system"]
        new = _input_messages(body.get("input"))
        messages = history + new
        if body.get("instructions"):
            messages = [{"role": "system", "content": str(body["instructions"])}, *messages]
        fields: dict[str, Any] = {
            "model": body.get("model"), "messages": messages,
            "max_tokens": body.get("max_output_tokens"), "stream": stream,
            "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": _response_format(body.get("text"))}
        for k in ("temperature", "top_p"):
            if body.get(k) is not None:
                fields[k] = body[k]
        try:
            return ChatCompletionRequest.model_validate(fields), messages
        except Exception as e:
            errs = getattr(e, "errors", lambda: [])()
            loc = str(errs[0]["loc"][0]) if errs and errs[0].get("loc") else None
            loc = {"max_tokens": "max_output_tokens", "messages": "input"}.get(loc, loc)
            raise RequestError(f"{loc}: {errs[0]['msg']}" if errs else "invalid request",
                               loc) from None

    async def create(self, body: Any, raw_request: Request) -> Response:
        try:
            stream = bool(body.get("stream")) if isinstance(body, dict) else False
            req, messages = self._chat_request(body, stream)
            run = await start_chat(self.chat, req, raw_request, "resp")
        except Exception as e:
            return engine_error_response(e)
        base = self._base(body, req, run)
        if stream:
            return StreamingResponse(self._stream(run, base, messages, body),
                                     media_type="text/event-stream")
        try:
            msg = await run.run()
        except Exception as e:
            return engine_error_response(e)
        resp = self._complete(base, run, msg)
        self._save(body, messages, msg, resp)
        return JSONResponse(resp)

    def get(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            return error_response(f"Response with id {response_id!r} not found",
                                  status=404, param="response_id",
                                  code="response_not_found")
        return JSONResponse(stored[1])

    def _base(self, body: dict[str, Any], req: ChatCompletionRequest,
              run: ChatRun) -> dict[str, Any]:
        return {
            "id": run.public_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": req.model or self.chat.state.model_name,
            "output": [], "instructions": body.get("instructions"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "error": None,
            "incomplete_details": None, "usage": None}

    @staticmethod
    def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}

    @staticmethod
    def _call_item(c: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"),
                "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": "completed"}

    def _complete(self, base: dict[str, Any], run: ChatRun,
                  msg: dict[str, Any], msg_id: str | None = None) -> dict[str, Any]:
        output = []
        if msg.get("content") or not msg.get("tool_calls"):
            output.append(self._message_item(msg_id or f"msg_{uuid.uuid4().hex[:24]}",
                                             msg.get("content") or "", "completed"))
        output += [self._call_item(c) for c in msg.get("tool_calls") or []]
        incomplete = run.finish_reason == "length"
        return {**base, "status": "incomplete" if incomplete else "completed",
                "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete
                else None,
                "usage": {"input_tokens": run.num_prompt_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": run.num_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": run.num_prompt_tokens + run.num_tokens}}

    def _save(self, body: dict[str, Any], messages: list[dict[str, Any]],
              msg: dict[str, Any], resp: dict[str, Any]) -> None:
        if body.get("store", True) is False:
            return
        turn = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            turn["tool_calls"] = msg["tool_calls"]
        self.store.put(resp["id"], [*messages, turn], resp)

    async def _stream(self, run: ChatRun, base: dict[str, Any],
                      messages: list[dict[str, Any]], body: dict[str, Any]
                      ) -> AsyncIterator[bytes]:
        seq = 0

        def ev(kind: str, **data: Any) -> bytes:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return (f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}"
                    "\n\n").encode()

        yield ev("response.created", response=base)
        yield ev("response.in_progress", response=base)
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        text, opened, calls = "", False, []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        try:
            async for d in run.deltas():
                if d.get("content"):
                    if not opened:
                        opened = True
                        yield ev("response.output_item.added", output_index=0,
                                 item=self._message_item(msg_id, "", "in_progress"))
                        yield ev("response.content_part.added", item_id=msg_id,
                                 output_index=0, content_index=0, part=part)
                    text += d["content"]
                    yield ev("response.output_text.delta", item_id=msg_id, output_index=0,
                             content_index=0, delta=d["content"], logprobs=[])
                calls += d.get("tool_calls") or []
        except Exception as e:
            resp = engine_error_response(e)
            err = json.loads(bytes(resp.body)).get("error", {})
            yield ev("error", code=err.get("code"), message=err.get("message", "error"),
                     param=err.get("param"))
            return
        msg = {"role": "assistant", "content": text or None,
               "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
        final = self._complete(base, run, msg, msg_id)
        index = 0
        if opened:
            yield ev("response.output_text.done", item_id=msg_id, output_index=0,
                     content_index=0, text=text, logprobs=[])
            yield ev("response.content_part.done", item_id=msg_id, output_index=0,
                     content_index=0, part={**part, "text": text})
            yield ev("response.output_item.done", output_index=0, item=final["output"][0])
            index = 1
        for item in final["output"][index:]:
            if item["type"] != "function_call":
                continue
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress"})
            yield ev("response.function_call_arguments.done", item_id=item["id"],
                     output_index=index, arguments=item["arguments"], name=item["name"])
            yield ev("response.output_item.done", output_index=index, item=item)
            index += 1
        self._save(body, messages, msg, final)
        yield ev("response.completed" if final["status"] == "completed"
                 else "response.incomplete", response=final)
