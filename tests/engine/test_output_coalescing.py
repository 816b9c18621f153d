"""Delta outputs queued for a slow consumer are merged (RequestOutput.add)."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.engine.async_llm import _OutputStream
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


def _delta(index: int, text: str, ids: list[int], finish: str | None = None,
           lp: bool = False) -> RequestOutput:
    logprobs = [{t: Logprob(-0.5 * t, 1)} for t in ids] if lp else None
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
        outputs=[CompletionOutput(index, text, list(ids), -float(sum(ids)), logprobs,
                                  finish, "x" if finish else None)],
        finished=finish is not None)


def test_add_appends_per_index_and_copies() -> None:
    first = _delta(0, "a", [1], lp=True)
    own_ids = first.outputs[0].token_ids
    first.add(_delta(1, "z", [9]))
    first.add(_delta(0, "b", [2, 3], lp=True))
    first.add(_delta(0, "c", [4], finish="stop", lp=True))
    by_index = {c.index: c for c in first.outputs}
    assert by_index[0].text == "abc"
    assert by_index[0].token_ids == [1, 2, 3, 4]
    assert by_index[0].logprobs is not None
    assert [next(iter(d)) for d in by_index[0].logprobs] == [1, 2, 3, 4]
    assert by_index[0].cumulative_logprob == -4.0  # the later delta's
    assert (by_index[0].finish_reason, by_index[0].stop_reason) == ("stop", "x")
    assert by_index[1].text == "z" and by_index[1].token_ids == [9]
    assert first.finished
    assert own_ids == [1]  # the first delta's list was copied, not extended


def test_stream_merges_what_is_queued_and_keeps_errors_in_order() -> None:
    async def run() -> None:
        sink = _OutputStream()
        for i, t in enumerate("abc"):
            sink.put(_delta(0, t, [i]))
        got = await sink.get()
        assert got.outputs[0].text == "abc" and got.outputs[0].token_ids == [0, 1, 2]
        sink.put(_delta(0, "d", [3]))
        sink.put(RuntimeError("core died"))
        sink.put(_delta(0, "e", [4]))
        assert (await sink.get()).outputs[0].text == "d"  # delivered before the error
        with pytest.raises(RuntimeError, match="core died"):
            await sink.get()
        assert (await sink.get()).outputs[0].text == "e"

    asyncio.run(run())
