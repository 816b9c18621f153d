"""Which data-parallel engine a new request goes to: the one already holding its prompt's
prefix in its KV cache (device pool or host / disk tiers), unless that engine is busier
than the least-loaded one by more than a margin.

Why: data-parallel engines share nothing (``engine/dp_client.py``), so a conversation
whose turns are balanced by load alone lands on another engine about every other turn
with two engines, and that engine recomputes the whole history -- its prefix cache and
host tier (``core/offload_tier.py``) hold the other engine's conversations.  Sending
each turn where the previous ones ran gives every engine's cache its own conversations:
the hit rate of one engine with ``data_parallel_size`` times the memory, without a pool
shared across processes (which would need a cross-process index on every step).

What the router knows.  It never asks an engine: it remembers, per engine, the chained
hashes of the full ``block_size``-token blocks of the prompts it sent there (the root
carries the LoRA adapter and ``cache_salt``, which the engines' block hashes carry too),
least recently used first, at most as many as that engine's cache can hold (its device
blocks plus its offload tiers' blocks, from its last stats).  That is an estimate: an
engine may have evicted a block the router still lists, and the generated part of a
conversation (the engine caches it) is not listed, so a next turn matches its previous
prompt only.  A wrong estimate costs a cache miss, never a wrong answer.  Images are not
hashed (their placeholder tokens are): prompts that differ only in an image look alike.

The rule (``pick``), with ``outstanding`` the sequences each engine has not finished:

* the engine whose listed blocks match the longest prefix of the prompt, if the match
  covers at least ``MIN_MATCH_FRACTION`` of the prompt's full blocks (so a shared system
  prompt or chat template alone does not pull every request onto one engine) and that
  engine's ``outstanding`` exceeds the least-loaded engine's by at most
  ``max(MIN_SLACK, least * SLACK_FRACTION)``;
* otherwise the least-loaded engine (``fallback``: the DP client's order by load).

``data_parallel_routing="load"`` turns the prefix rule off (balance by load alone).
Torch-free: the frontend process runs it for every request (hashing a 2,000-token
prompt takes tens of microseconds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pagedllm.core.kv_cache_manager import hash_block

ROUTING_POLICIES = ("prefix", "load")
MIN_MATCH_FRACTION = 0.5
MIN_SLACK = 4
SLACK_FRACTION = 0.25
DEFAULT_CAPACITY = 1 << 16  # blocks listed per engine before its first stats arrive


def check_routing(policy: object) -> str:
    """``policy`` if it names a routing policy, else ``ValueError`` naming the argument."""
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"data_parallel_routing must be one of "
                         f"{', '.join(map(repr, ROUTING_POLICIES))}, got {policy!r}")
    return str(policy)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        root: object = None) -> list[int]:
    """Chained hashes of the prompt's full blocks (the engines' ``hash_block``, with
    ``root`` as every block's extra key): entry ``i`` names blocks ``0..i``."""
    out: list[int] = []
    h = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash_block(h, tuple(token_ids[start:start + block_size]), root)
        out.append(h)
    return out


class PrefixRouter:
    """Per engine, the prompt blocks sent there (module doc); ``pick`` chooses and
    records.  Not thread-safe: the DP client calls it from its event loop."""

    def __init__(self, num_engines: int, block_size: int) -> None:
        if num_engines < 1 or block_size < 1:
            raise ValueError(f"PrefixRouter: num_engines {num_engines} and block_size "
                             f"{block_size} must be positive")
        self.block_size = block_size
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict()
                                                     for _ in range(num_engines)]
        self.capacity = [DEFAULT_CAPACITY] * num_engines
        self.routed_by_prefix = [0] * num_engines  # requests the prefix rule placed

    def set_capacity(self, engine: int, blocks: int) -> None:
        """How many blocks ``engine`` can hold (device and offload tiers together); the
        oldest listed blocks beyond it are forgotten."""
        self.capacity[engine] = max(1, int(blocks))
        self._trim(engine)

    def matched_blocks(self, engine: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` the router lists for ``engine``."""
        listed = self._blocks[engine]
        n = 0
        for h in hashes:
            if h not in listed:
                break
            n += 1
        return n

    def pick(self, token_ids: Sequence[int], outstanding: Sequence[int],
             fallback: Callable[[], int], root: object = None) -> int:
        """The engine for a prompt of ``token_ids`` (the rule of the module doc), whose
        blocks are then listed for it.  ``outstanding[i]``: engine ``i``'s unfinished
        sequences; ``fallback()``: the least-loaded engine."""
        hashes = prompt_block_hashes(token_ids, self.block_size, root)
        least = choice = fallback()
        if hashes:
            matched = [self.matched_blocks(i, hashes) for i in range(len(self._blocks))]
            # The longest match; a tie goes to the least-loaded engine, then the lowest.
            best = max(range(len(matched)), key=lambda i: (matched[i], i == least, -i))
            slack = max(MIN_SLACK, int(outstanding[least] * SLACK_FRACTION))
            if matched[best] >= MIN_MATCH_FRACTION * len(hashes) \
                    and outstanding[best] <= outstanding[least] + slack:
                choice = best
                self.routed_by_prefix[best] += 1
        self._record(choice, hashes)
        return choice

    def _record(self, engine: int, hashes: Sequence[int]) -> None:
        # Last block first: the prompt's first blocks end most recently used, so the
        # trim forgets a prompt from its tail, as the engines' LRU pools evict it.
        listed = self._blocks[engine]
        for h in reversed(hashes):
            listed[h] = None
            listed.move_to_end(h)
        self._trim(engine)

    def _trim(self, engine: int) -> None:
        listed = self._blocks[engine]
        while len(listed) > self.capacity[engine]:
            listed.popitem(last=False)
