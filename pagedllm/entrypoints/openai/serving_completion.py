"""``POST /v1/completions``: prompts (text, token ids, or lists of either), n, echo,
logprobs, stop, streaming (SSE) with ``stream_options.include_usage``.

Choice indices follow OpenAI: prompt ``p``'s sample ``i`` is choice ``p * n + i``.
Outputs arrive as deltas from ``AsyncLLM``; the non-streaming path accumulates them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai.protocol import CompletionRequest
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
from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs


@dataclass
class _Choice:
    """Accumulated state of one choice."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    echoed: bool = False
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # set by the first delta
    sent_prompt_ids: bool = False
    sent_prompt_logprobs: bool = False


class OpenAIServingCompletion(ServingHandler):
    async def create_completion(self, body: CompletionRequest,
                                raw_request: Request) -> Response:
        st = self.state
        try:
            st.check_unknown(body)
            st.check_model(body.model)
            body.validate_request(st.max_n, st.max_logprobs)
            prompts = body.prompts()
            st.check_num_inputs(len(prompts), "prompt")
            params = body.to_sampling_params(st.vocab_size)
            st.check_admitting()
            public_id = st.public_id(raw_request, "cmpl", body.request_id)
            streams = await st.start(public_id, list(prompts), params, body.priority,
                                     add_special_tokens=body.add_special_tokens,
                                     model=body.model, raw_request=raw_request)
        except Exception as e:
            return engine_error_response(e)
        created = int(time.time())
        model = body.model or st.model_name
        n = params.n
        if body.stream:
            return StreamingResponse(
                self._stream(body, public_id, streams, n, created, model),
                media_type="text/event-stream")
        return await with_cancellation(raw_request, lambda: self._full(
            body, public_id, streams, n, created, model))

    # ------------------------------------------------------------------ conversion

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(out.prompt_token_ids)

    def _add_logprobs(self, ch: _Choice, token_ids: list[int],
                      logprobs: SampleLogprobs | PromptLogprobs | None,
                      num_top: int) -> None:
        if logprobs is None:
            return
        offset = len(ch.text)
        for tid, lps in zip(token_ids, logprobs):
            if lps is None:  # the first prompt token has no logprob
                text = self.tokenizer.decode([tid]) if self.tokenizer is not None else ""
                ch.tokens.append(text)
                ch.token_logprobs.append(None)
                ch.top_logprobs.append(None)
            else:
                chosen = lps.get(tid)
                text = token_text(chosen, tid, self.tokenizer) if chosen else str(tid)
                ch.tokens.append(text)
                ch.token_logprobs.append(logprob_value(chosen.logprob) if chosen else None)
                top = {token_text(lp, t, self.tokenizer): logprob_value(lp.logprob)
                       for t, lp in lps.items()
                       if t == tid or (lp.rank is not None and lp.rank <= num_top)}
                ch.top_logprobs.append(top if num_top > 0 else None)
            ch.text_offset.append(offset)
            offset += len(text)

    def _apply(self, body: CompletionRequest, ch: _Choice, out: RequestOutput,
               c: CompletionOutput) -> tuple[str, int]:
        """Fold one delta into ``ch``; returns (text delta incl. echo, logprob start)."""
        lp_start = len(ch.tokens)
        delta = ""
        if body.echo and not ch.echoed:
            ch.echoed = True
            prompt_text = self._prompt_text(out)
            if body.logprobs is not None:
                self._add_logprobs(ch, out.prompt_token_ids, out.prompt_logprobs,
                                   body.logprobs)
            delta += prompt_text
            ch.text += prompt_text
        if body.prompt_only:  # the engine's one token is not part of the answer
            if body.return_token_ids and ch.prompt_token_ids is None:
                ch.prompt_token_ids = list(out.prompt_token_ids)
            if c.finish_reason is not None and ch.finish_reason is None:
                ch.finish_reason = "length"
            return delta, lp_start
        if body.logprobs is not None:
            self._add_logprobs(ch, c.token_ids, c.logprobs, body.logprobs)
        delta += c.text
        ch.text += c.text
        ch.num_tokens += len(c.token_ids)
        if body.return_token_ids:
            ch.token_ids += c.token_ids
            if ch.prompt_token_ids is None:
                ch.prompt_token_ids = list(out.prompt_token_ids)
        if c.finish_reason is not None and ch.finish_reason is None:
            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        return delta, lp_start

    def _prompt_logprobs_json(self, token_ids: list[int], logprobs: PromptLogprobs,
                              ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``choices[i].prompt_logprobs``: per prompt token (the first is null), the
        token itself and the top ``prompt_logprobs`` alternatives, keyed by token id."""
        return [None if lps is None else {
            str(t): {"logprob": logprob_value(lp.logprob), "rank": lp.rank,
                     "decoded_token": token_text(lp, t, self.tokenizer)}
            for t, lp in lps.items()} for _, lps in zip(token_ids, logprobs)]

    @staticmethod
    def _logprobs_json(ch: _Choice, start: int) -> dict[str, Any]:
        return {"text_offset": ch.text_offset[start:],
                "token_logprobs": ch.token_logprobs[start:],
                "tokens": ch.tokens[start:], "top_logprobs": ch.top_logprobs[start:]}

    # ------------------------------------------------------------------ non-streaming

    async def _full(self, body: CompletionRequest, public_id: str,
                    streams: list[RequestStream], n: int, created: int,
                    model: str) -> Response:
        choices = [_Choice() for _ in range(len(streams) * n)]
        num_prompt = [0] * len(streams)
        prompt_lps: list[list[dict[str, dict[str, Any]] | None] | None] = [None] * len(streams)
        try:
            async for p, out in merge_streams(streams):
                num_prompt[p] = num_prompt[p] or len(out.prompt_token_ids)
                if body.prompt_logprobs is not None and prompt_lps[p] is None \
                        and out.prompt_logprobs is not None:
                    prompt_lps[p] = self._prompt_logprobs_json(out.prompt_token_ids,
                                                               out.prompt_logprobs)
                for c in out.outputs:
                    ch = choices[p * n + c.index]
                    if ch.finish_reason is None:
                        self._apply(body, ch, out, c)
        except Exception as e:
            return engine_error_response(e)
        finally:
            self.state.finish(public_id, streams)
        completion_tokens = sum(ch.num_tokens for ch in choices)
        prompt_tokens = sum(num_prompt)
        return JSONResponse({
            "id": public_id, "object": "text_completion", "created": created,
            "model": model,
            "choices": [{
                "index": i, "text": ch.text,
                "logprobs": self._logprobs_json(ch, 0) if body.logprobs is not None
                else None,
                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                **({"token_ids": ch.token_ids, "prompt_token_ids": ch.prompt_token_ids}
                   if body.return_token_ids else {}),
                **({"prompt_logprobs": prompt_lps[i // n]}
                   if body.prompt_logprobs is not None else {}),
            } for i, ch in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    # ------------------------------------------------------------------ streaming

    async def _stream(self, body: CompletionRequest, public_id: str,
                      streams: list[RequestStream], n: int, created: int,
                      model: str) -> AsyncIterator[bytes]:
        choices = [_Choice() for _ in range(len(streams) * n)]
        num_prompt = [0] * len(streams)
        prompt_lps: dict[int, list[dict[str, dict[str, Any]] | None]] = {}
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        try:
            async for p, out in merge_streams(streams):
                num_prompt[p] = num_prompt[p] or len(out.prompt_token_ids)
                if out.prompt_logprobs is not None and p not in prompt_lps:
                    prompt_lps[p] = self._prompt_logprobs_json(out.prompt_token_ids,
                                                               out.prompt_logprobs)
                for c in out.outputs:
                    idx = p * n + c.index
                    ch = choices[idx]
                    if ch.finish_reason is not None:
                        continue
                    delta, lp_start = self._apply(body, ch, out, c)
                    if not delta and ch.finish_reason is None and not c.token_ids:
                        continue
                    choice: dict[str, Any] = {
                        "index": idx, "text": delta,
                        "logprobs": self._logprobs_json(ch, lp_start)
                        if body.logprobs is not None else None,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": ch.stop_reason,
                    }
                    if body.return_token_ids:
                        choice["token_ids"] = [] if body.prompt_only else list(c.token_ids)
                        if not ch.sent_prompt_ids:
                            ch.sent_prompt_ids = True
                            choice["prompt_token_ids"] = ch.prompt_token_ids
                    if body.prompt_logprobs is not None and not ch.sent_prompt_logprobs:
                        # vLLM's place for them: each choice's first chunk (the engine
                        # reports them once per prompt; n > 1 choices share them).
                        ch.sent_prompt_logprobs = True
                        choice["prompt_logprobs"] = prompt_lps.get(p)
                    chunk: dict[str, Any] = {
                        "id": public_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = _usage(sum(num_prompt), choices) if continuous \
                            else None
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": public_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [],
                           "usage": _usage(sum(num_prompt), choices)})
        except Exception as e:
            # Headers are gone already: report in-band, then end the stream normally.
            yield sse_error(e)
        finally:
            self.state.finish(public_id, streams)
        yield SSE_DONE


def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict[str, int]:
    return usage(prompt_tokens, sum(ch.num_tokens for ch in choices))
