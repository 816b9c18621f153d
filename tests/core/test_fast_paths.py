"""The per-step fast paths change nothing: ``allocate_slots``' steady-decode shortcut,
``requires_sync``'s candidate set and the cached token counts on ``Request``.

Two schedulers run the same random workload (n > 1 forks, beams, prefix caching,
recompute or swap preemption, aborts); one always takes the full allocation path.  Every
``SchedulerOutput`` and every reported token must be identical, step by step.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import EngineCoreOutput
from pagedllm.request import Request
from tests.core.fake_runner import FakeRunner
from tests.core.test_memory_sharing import make, req


def _slow_path_only(kv: KVCacheManager) -> None:
    """Make ``kv.allocate_slots`` always take the full path (the reference)."""
    def allocate_slots(request, num_new_tokens, new_computed_blocks=None):
        return kv._allocate_slots(request, num_new_tokens, new_computed_blocks or [])
    kv.allocate_slots = allocate_slots  # type: ignore[method-assign]


def _requires_sync_reference(s: Scheduler) -> bool:
    """``requires_sync`` as a loop over every live request."""
    if s.beams.groups or s.config.preemption_mode == "swap":
        return True
    for r in s.requests.values():
        sp = r.sampling_params
        if (r.fork_ids or sp.prompt_logprobs is not None or sp.presence_penalty
                or sp.frequency_penalty or sp.repetition_penalty != 1.0):
            return True
    return False


def _untimed(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """The outputs with wall-clock times replaced by whether they were set."""
    return [msgspec.structs.replace(o, first_scheduled_time=o.first_scheduled_time is not None)
            for o in outputs]


def _check_counts(r: Request) -> None:
    assert r.num_tokens == len(r.all_token_ids)
    assert r.num_output_tokens == len(r.output_token_ids)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 14), st.integers(1, 12),
                              st.integers(1, 3)), min_size=1, max_size=10),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       num_blocks=st.integers(9, 40), abort_every=st.integers(0, 7),
       policy=st.sampled_from(["fcfs", "throughput"]))
def test_fast_paths_equal_the_full_path(ops, mode, caching, num_blocks, abort_every, policy):
    fast, slow = (make(num_blocks=num_blocks, budget=24, max_seqs=8, caching=caching,
                       mode=mode, cpu_blocks=12, swap_per_step=6, max_model_len=64,
                       policy=policy)
                  for _ in range(2))
    _slow_path_only(slow.kv)
    added: list[str] = []
    for i, (kind, plen, max_tokens, n) in enumerate(ops):
        prompt = [(7 * i + j) % 5 + 1 for j in range(plen)]  # repetitive: cache hits
        for s in (fast, slow):
            if kind == 0:
                r = req(f"q{i}", prompt, max_tokens, n=min(n, 2), beam=2)
            elif kind == 1:
                r = req(f"q{i}", prompt, max_tokens, min_tokens=min(3, max_tokens))
            else:
                r = req(f"q{i}", prompt, max_tokens, n=n, seed=i if kind % 2 else None)
            try:
                s.add_request(r)
            except ValueError:
                continue  # cannot fit this pool (the same for both)
            if s is fast:
                added.append(r.request_id)
    runners = FakeRunner(fast.block_size, fast.kv.pool), FakeRunner(slow.block_size,
                                                                     slow.kv.pool)
    for step in range(5000):
        if not fast.has_unfinished_requests():
            break
        assert fast.requires_sync() == _requires_sync_reference(fast)
        if abort_every and step % abort_every == abort_every - 1 and added:
            rid = added.pop()
            fast.finish_requests([rid])
            slow.finish_requests([rid])
        so_fast, so_slow = fast.schedule(), slow.schedule()
        assert so_fast == so_slow
        out_fast = fast.update_from_output(so_fast, runners[0].execute_model(so_fast))
        out_slow = slow.update_from_output(so_slow, runners[1].execute_model(so_slow))
        assert _untimed(out_fast.outputs) == _untimed(out_slow.outputs)
        # Same blocks registered in the prefix cache, at the same steps.
        assert ({h: b.block_id for h, b in fast.kv.pool.cached_blocks.items()}
                == {h: b.block_id for h, b in slow.kv.pool.cached_blocks.items()})
        for r in fast.requests.values():
            _check_counts(r)
    else:
        raise AssertionError("did not finish")
    assert not slow.has_unfinished_requests()
    assert fast.kv.pool.num_free_blocks == fast.kv.num_usable_blocks
