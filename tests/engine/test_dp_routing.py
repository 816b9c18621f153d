"""Prefix-aware placement of requests on data-parallel engines (``engine/dp_routing.py``):
a conversation's next turn goes to the engine that ran its history unless that engine is
clearly busier; a short shared prefix (a system prompt) does not attract; the router
forgets a prompt from its tail, keeps adapters and salts apart, and the argument is
checked."""

from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import make_parallel_config
from pagedllm.engine.dp_routing import (
    MIN_SLACK,
    PrefixRouter,
    check_routing,
    prompt_block_hashes,
)

BS = 16


def _ids(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 50000 for i in range(n)]


def _least(outstanding: list[int]):  # the DP client's order by load, ties to the lower
    return lambda: min(range(len(outstanding)), key=lambda i: (outstanding[i], i))


def test_next_turn_follows_its_history_not_the_load() -> None:
    r = PrefixRouter(2, BS)
    out = [0, 0]
    a, b = _ids(1, 100), _ids(2, 100)
    assert r.pick(a, out, _least(out)) == 0
    out[0] += 1
    assert r.pick(b, out, _least(out)) == 1
    out[1] += 1
    # Turn 2 of each, in the other order: by load alone a would now go to engine 0 only
    # by chance; the router sends each where its history is.
    out = [1, 0]
    assert r.pick(b + _ids(3, 40), out, _least(out)) == 1
    assert r.pick(a + _ids(4, 40), [0, 3], _least([0, 3])) == 0
    assert r.routed_by_prefix == [1, 1]


def test_busy_engine_loses_its_affinity_beyond_the_slack() -> None:
    r = PrefixRouter(2, BS)
    a = _ids(1, 160)
    assert r.pick(a, [0, 0], _least([0, 0])) == 0
    turn2 = a + _ids(5, 32)
    assert r.pick(turn2, [MIN_SLACK, 0], _least([MIN_SLACK, 0])) == 0  # within slack
    busy = [MIN_SLACK + 1, 0]
    assert r.pick(turn2, busy, _least(busy)) == 1  # clearly busier: balance instead
    # (turn2 is now listed on both engines: a tie goes to the least loaded.)
    assert r.pick(turn2, [0, 1], _least([0, 1])) == 0
    # The slack grows with the load: 25% of the least-loaded engine's count.
    r = PrefixRouter(2, BS)
    r.pick(a, [0, 0], _least([0, 0]))
    assert r.pick(turn2, [50, 40], _least([50, 40])) == 0
    assert r.pick(turn2, [51, 40], _least([51, 40])) == 1


def test_a_shared_system_prompt_alone_does_not_attract() -> None:
    r = PrefixRouter(2, BS)
    system = _ids(9, 32)  # two blocks every request shares
    assert r.pick(system + _ids(1, 64), [0, 0], _least([0, 0])) == 0
    # Two of six blocks match engine 0: under half, so load decides.
    assert r.pick(system + _ids(2, 64), [1, 0], _least([1, 0])) == 1
    assert r.routed_by_prefix == [0, 0]


def test_capacity_forgets_the_tail_first_and_roots_stay_apart() -> None:
    r = PrefixRouter(2, BS)
    a = _ids(1, 8 * BS)
    r.pick(a, [0, 0], _least([0, 0]))
    hashes = prompt_block_hashes(a, BS)
    assert r.matched_blocks(0, hashes) == 8
    r.set_capacity(0, 5)  # the first five blocks were used last: they stay
    assert r.matched_blocks(0, hashes) == 5
    assert r.matched_blocks(1, hashes) == 0
    # Another adapter or cache salt hashes apart: no match on engine 0.
    assert r.matched_blocks(0, prompt_block_hashes(a, BS, root=(1, None))) == 0
    assert r.matched_blocks(0, prompt_block_hashes(a, BS, root=(None, "salt"))) == 0
    assert prompt_block_hashes(a[:BS - 1], BS) == []  # no full block: nothing to match


def test_routing_argument_is_checked() -> None:
    assert check_routing("load") == "load"
    with pytest.raises(ValueError, match="data_parallel_routing"):
        check_routing("random")
    with pytest.raises(ValueError, match="data_parallel_routing"):
        make_parallel_config(1, 1, 2, None, 60.0, routing="sticky")
    assert make_parallel_config(1, 1, 2, None, 60.0).data_parallel_routing == "prefix"
