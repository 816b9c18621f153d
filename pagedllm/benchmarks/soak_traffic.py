"""The request mix of ``pagedllm bench soak``: one function per kind, one outcome each.

Kinds (weights in ``MIX``): ``valid`` (non-streamed completion or chat), ``stream``
(streamed, read to ``[DONE]``), ``invalid`` (a body the server must refuse with a 4xx),
``cancelled`` (streamed, the client disconnects after a few chunks) and ``timeout`` (the
client gives up after 0.05-0.5 s).  Every choice is drawn from the caller's
``random.Random``, so a seed fixes each worker's sequence of requests.

An outcome is ``ok`` (the expected behaviour for the kind), ``overloaded`` (503: allowed,
admission control), or ``failure`` with a reason: any other 5xx, a transport error
(refused, reset, server disconnected) on a request the client did not abandon, a valid
request refused, an invalid one accepted, or a stream without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

MIX = {"valid": 30, "stream": 25, "invalid": 20, "cancelled": 15, "timeout": 10}
_WORDS = ("the", "river", "a", "small", "robot", "sings", "under", "quiet", "stars",
          "why", "does", "bread", "rise", "tell", "me", "about", "winter", "code")


@dataclass
class Outcome:
    kind: str
    result: str  # "ok" | "overloaded" | "failure"
    detail: str = ""


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12)))


def _body(rng: random.Random, model: str, stream: bool, max_tokens: int) -> tuple[str, dict]:
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream,
                              "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": _prompt(rng)}
    return "/v1/chat/completions", {
        **common, "messages": [{"role": "user", "content": _prompt(rng)}]}


def _invalid(rng: random.Random, model: str, max_model_len: int) -> tuple[str, Any]:
    """A request body every OpenAI-compatible server here must refuse with a 4xx."""
    p = _prompt(rng)
    cases: list[tuple[str, Any]] = [
        ("/v1/completions", {"model": model, "prompt": p, "temperature": -1}),
        ("/v1/completions", {"model": model, "prompt": p, "max_tokens": 0}),
        ("/v1/completions", {"model": model, "prompt": p, "top_p": 2}),
        ("/v1/completions", {"model": model, "prompt": p, "n": 0}),
        ("/v1/completions", {"model": model}),
        ("/v1/completions", {"model": model, "prompt": p, "no_such_field": 1}),
        ("/v1/completions", {"model": "no-such-model", "prompt": p}),
        ("/v1/completions", {"model": model, "prompt": p, "max_tokens": max_model_len * 4}),
        ("/v1/chat/completions", {"model": model, "messages": []}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "nobody"}]}),
        ("/v1/completions", "this is not json"),
        ("/v1/completions", [1, 2, 3]),
    ]
    return rng.choice(cases)


def _classify_status(kind: str, status: int) -> Outcome | None:
    if status == 503:
        return Outcome(kind, "overloaded")
    if status >= 500:
        return Outcome(kind, "failure", f"HTTP {status}")
    return None


async def _read_stream(resp: aiohttp.ClientResponse, stop_after: int | None) -> str:
    """Read SSE lines; returns "done", "cut" (stopped after ``stop_after`` chunks) or
    "truncated" (the body ended without ``[DONE]``)."""
    chunks = 0
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "done"
        json.loads(line[len("data: "):])
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            return "cut"
    return "truncated"


async def run_one(session: aiohttp.ClientSession, rng: random.Random, kind: str,
                  model: str, max_model_len: int) -> Outcome:
    """Send one request of ``kind``; never raises (every error is an outcome)."""
    try:
        return await _run(session, rng, kind, model, max_model_len)
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        return Outcome(kind, "failure", f"{type(e).__name__}: {e}"[:200])


async def _run(session: aiohttp.ClientSession, rng: random.Random, kind: str, model: str,
               max_model_len: int) -> Outcome:
    if kind == "invalid":
        path, body = _invalid(rng, model, max_model_len)
        kw: dict[str, Any] = ({"data": body, "headers": {"content-type": "application/json"}}
                              if isinstance(body, str) else {"json": body})
        async with session.post(path, **kw) as r:
            await r.read()
            if (o := _classify_status(kind, r.status)) is not None:
                return o
            if 400 <= r.status < 500:
                return Outcome(kind, "ok")
            return Outcome(kind, "failure", f"invalid request accepted ({r.status}): {body}")
    if kind == "timeout":
        path, body = _body(rng, model, rng.random() < 0.5, rng.randint(64, 128))
        body["ignore_eos"] = True
        limit = rng.uniform(0.05, 0.5)
        try:
            async with session.post(path, json=body,
                                    timeout=aiohttp.ClientTimeout(total=limit)) as r:
                await r.read()
                return _classify_status(kind, r.status) or Outcome(kind, "ok", "finished")
        except asyncio.TimeoutError:
            return Outcome(kind, "ok", "timed out")
    stream = kind in ("stream", "cancelled")
    path, body = _body(rng, model, stream, rng.randint(1, 24))
    if kind == "cancelled":
        body["max_tokens"] = rng.randint(32, 96)
        body["ignore_eos"] = True
    async with session.post(path, json=body) as r:
        if (o := _classify_status(kind, r.status)) is not None:
            await r.read()
            return o
        if r.status != 200:
            return Outcome(kind, "failure", f"valid request refused ({r.status}): "
                           f"{(await r.text())[:200]}")
        if not stream:
            json.loads(await r.read())
            return Outcome(kind, "ok")
        how = await _read_stream(r, rng.randint(1, 3) if kind == "cancelled" else None)
        if how == "cut":
            r.close()  # the client disconnects mid-stream
            return Outcome(kind, "ok", "cancelled")
        if how == "truncated":
            return Outcome(kind, "failure", "stream ended without [DONE]")
        return Outcome(kind, "ok")
