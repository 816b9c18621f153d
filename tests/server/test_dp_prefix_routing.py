"""Data-parallel routing by cached prefix, end to end: two engine cores behind one
``pagedllm serve`` (the default ``--data-parallel-routing prefix``).  Four conversations
run a first turn concurrently (spread over both engines by load); their second turns,
sent in the reverse order, each go to the engine that ran the first -- every second
turn is served its history from that engine's prefix cache -- and the answers equal the
ones a single engine gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.server.harness import running_server

BLOCK = 16  # the server's default block size


def _history(c: int) -> list[int]:
    """A conversation's first prompt: 96 token ids (six blocks) of its own."""
    return [1000 + (c * 7919 + i * 104729) % 40000 for i in range(96)]


def _turn2(c: int) -> list[int]:
    return _history(c) + [2000 + c * 37 + i for i in range(40)]  # 8 blocks, 6 cached


def _complete(url: str, prompt: list[int]) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                    max_tokens=4, temperature=0, logprobs=0)
    return out.choices[0].logprobs.tokens


def _run(url: str, metrics) -> tuple[list[list[str]], float]:  # type: ignore[no-untyped-def]
    """Both turns of the four conversations; the prefix-cache hit tokens of the second."""
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda c: _complete(url, _history(c)), range(4)))
        hits0 = metrics()["vllm:prefix_cache_hits_total"]
        second = list(pool.map(lambda c: _complete(url, _turn2(c)), reversed(range(4))))
    return first + second[::-1], metrics()["vllm:prefix_cache_hits_total"] - hits0


def test_second_turns_go_where_their_history_is() -> None:
    with running_server("--max-num-seqs", "4") as one:
        ref, _ = _run(one.url, one.metrics)
    with running_server("-dp", "2", "--max-num-seqs", "4") as s:
        assert "requests routed by cached prefix, then load" in s.log()
        got, hits = _run(s.url, s.metrics)
        m = s.metrics()
        assigned = [m[f'pagedllm:engine_requests_assigned{{engine="{i}"}}'] for i in (0, 1)]
        routed = [m[f'pagedllm:engine_requests_prefix_routed{{engine="{i}"}}']
                  for i in (0, 1)]
    assert got == ref
    # First turns by load (about two each: a first turn may finish before the last is
    # sent), second turns by prefix: every one found its six history blocks cached on
    # its engine (by load alone, turned round, about half would).
    assert sum(assigned) == 8 and min(assigned) >= 2, assigned
    assert sum(routed) == 4, routed
    assert hits >= 4 * 6 * BLOCK, hits
