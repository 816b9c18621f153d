"""A temperature-0 chat request gives the same tokens and logprobs, bit for bit, alone
and under concurrent traffic, streamed and not (issue 46, item 21(b): under load a
greedy request and the same request streamed once answered differently).

The server runs the default model (Q4_1 GGUF on the CPU) with 32 tokens per step, so
the other requests' prompts are chunked and share steps with our request's prefill and
decodes; every step is paced (``hooks_env``), so the traffic is still running while our
request is served on any machine.  The equality itself does not depend on timing: each
row's arithmetic is independent of its step (``attention/cpu_backend.py``), whatever
the scheduler packs together.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from tests.server.harness import ServerProcess, hooks_env, running_server, wait_until

ASK = [{"role": "user", "content": "Name three fruits, comma separated."}]
OTHERS = ["Write a short poem about the sea.", "Explain gravity to a child.",
          "List five European capitals and one fact about each."]


def _chat(s: ServerProcess, messages: list[dict[str, str]], stream: bool,
          max_tokens: int = 24) -> list[tuple[str, float]]:
    """The reply's (token, logprob) pairs, from the whole response or its SSE chunks."""
    body: dict[str, Any] = {"messages": messages, "temperature": 0,
                            "max_tokens": max_tokens, "logprobs": True, "stream": stream,
                            "ignore_eos": True}
    with s.client() as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return [(t["token"], t["logprob"])
                    for t in r.json()["choices"][0]["logprobs"]["content"]]
        out: list[tuple[str, float]] = []
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[len("data: "):])["choices"]:
                    out += [(t["token"], t["logprob"])
                            for t in (ch.get("logprobs") or {}).get("content") or []]
        return out


def test_greedy_chat_is_the_same_alone_and_under_traffic() -> None:
    with running_server("--max-num-batched-tokens", "32",
                        env=hooks_env(step_pace_s=0.02)) as s:
        alone = _chat(s, ASK, stream=False)
        assert len(alone) == 24
        assert _chat(s, ASK, stream=True) == alone  # also a prefix-cache hit
        got: dict[str, list[tuple[str, float]]] = {}
        traffic = [threading.Thread(target=_chat, args=(s, [{"role": "user",
                                                              "content": o}], i % 2 == 0,
                                                         160)) for i, o in enumerate(OTHERS)]
        for t in traffic:
            t.start()
        assert wait_until(lambda: s.metrics().get("vllm:num_requests_running", 0) >= 2)
        for stream in (False, True):
            got[str(stream)] = _chat(s, ASK, stream=stream)
        for t in traffic:
            t.join()
        assert got == {"False": alone, "True": alone}
