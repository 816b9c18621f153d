"""Bounds on grammar work (issue 46 items 5 and 6): the up-front size limits, the
checker's killable worker processes (time budget, abandoned checks) and the compiled-
grammar cache's byte bound.  CPU only, no model: the checker runs without a vocabulary
and the cache compiles against a 257-token byte vocabulary."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import xgrammar as xgr

from pagedllm.structured_output import limits
from pagedllm.structured_output.backend import GrammarCompiler, validate
from pagedllm.structured_output.checker import CheckAbandoned, GrammarChecker, GrammarCheckError
from pagedllm.structured_outputs_params import StructuredOutputsParams as SO


def nested_arrays(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


def big_ebnf(rules: int) -> str:
    body = "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(rules))
    return f'root ::= r0\n{body}\nr{rules} ::= "z"'


@pytest.mark.parametrize("so, limit", [
    (SO(json=nested_arrays(900)), "64 levels"),
    (SO(json={"type": "object", "properties": {"a": nested_arrays(70)}}), "64 levels"),
    (SO(json={"type": "string", "enum": [f"v{i}" for i in range(50_000)]}), "10000"),
    (SO(grammar=big_ebnf(5_000)), "1000"),
    (SO(regex="(" * 100 + "a" + ")" * 100), "64 levels"),
    (SO(regex="a" * (limits.MAX_CONSTRAINT_CHARS + 1)), str(limits.MAX_CONSTRAINT_CHARS)),
    (SO(choice=[str(i) for i in range(20_000)]), "10000"),
])
def test_over_a_limit_is_refused_before_parsing(so: SO, limit: str) -> None:
    with pytest.raises(limits.ConstraintTooLarge) as e:
        limits.check_limits(so, "response_format")
    msg = str(e.value)
    assert msg.startswith("response_format: ") and limit in msg and "limit" in msg
    with pytest.raises(ValueError, match="limit"):  # validate checks them first
        validate(so, "response_format")


def test_within_the_limits_passes() -> None:
    for so in (SO(json=nested_arrays(60)), SO(grammar=big_ebnf(900)),
               SO(json={"enum": [f"v{i}" for i in range(9_000)]}), SO(regex="(a|b)+")):
        limits.check_limits(so)


def _stop_idle_worker(c: GrammarChecker) -> int:
    [w] = c._idle
    os.kill(w.proc.pid, signal.SIGSTOP)  # a compile that never ends, deterministically
    return w.proc.pid


def test_checker_kills_a_check_over_its_time_budget_and_recovers() -> None:
    async def run() -> None:
        c = GrammarChecker(None, num_workers=1, timeout=1.0)
        try:
            assert await c.check(SO(json={"type": "object"}), "guided_json") == 0
            with pytest.raises(GrammarCheckError, match="^guided_regex: .*invalid regex"):
                await c.check(SO(regex="(unclosed"), "guided_regex")
            pid = _stop_idle_worker(c)
            with pytest.raises(GrammarCheckError, match="^response_format: .*limit of 1 s"):
                await c.check(SO(json={"type": "string"}), "response_format")
            assert c.num_killed == 1 and not _alive(pid)
            # A fresh worker serves the next check.
            assert await c.check(SO(regex="[a-z]+"), "guided_regex") == 0
            # A constraint that passed is not checked again (its worker is stopped).
            _stop_idle_worker(c)
            assert await c.check(SO(json={"type": "object"}), "guided_json") == 0
        finally:
            await c.close()
    asyncio.run(run())


def test_checker_kills_the_worker_of_a_gone_client_and_of_a_cancelled_task() -> None:
    async def run() -> None:
        c = GrammarChecker(None, num_workers=1, timeout=60.0)
        try:
            await c.check(SO(json={"type": "object"}), "x")
            pid = _stop_idle_worker(c)

            async def gone() -> bool:
                return True

            t0 = time.monotonic()
            with pytest.raises(CheckAbandoned):
                await c.check(SO(json={"type": "string"}), "x", gone)
            assert time.monotonic() - t0 < 30 and not _alive(pid)
            await c.check(SO(json={"type": "array"}), "x")
            pid = _stop_idle_worker(c)
            task = asyncio.ensure_future(c.check(SO(json={"type": "string"}), "x"))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not _alive(pid) and c.num_killed == 2
        finally:
            await c.close()
    asyncio.run(run())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_compiled_grammar_cache_is_bounded_by_bytes() -> None:
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    comp = GrammarCompiler(None, 257)
    comp._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def enum(tag: str, n: int) -> SO:
        return SO(json={"enum": [f"{tag}-{i}" for i in range(n)]})

    one = comp._compiler.compile_grammar(
        xgr.Grammar.from_json_schema('{"enum": ["a"]}')).memory_size_bytes
    big = int(comp.compile(enum("probe", 400)).memory_size_bytes)
    assert big > 4 * one
    comp.max_cache_bytes = 3 * big
    comp._cache.clear()
    comp._sizes.clear()
    comp.cache_bytes = 0
    grammars = [enum(t, 400) for t in "abcdef"]
    for so in grammars:
        comp.compile(so)
        assert comp.cache_bytes <= comp.max_cache_bytes
    assert comp.cache_bytes == sum(comp._sizes.values())
    assert len(comp) < len(grammars)
    assert grammars[-1].key() in comp._cache and grammars[0].key() not in comp._cache
    comp.max_cache_bytes = big // 2  # one grammar larger than the whole bound: not kept
    comp._cache.clear()
    comp._sizes.clear()
    comp.cache_bytes = 0
    comp.compile(enum("huge", 400))
    assert len(comp) == 0 and comp.cache_bytes == 0
    comp.shutdown()
