"""The scheduler runs at most ``max_loras`` distinct adapters at once (skipping, not
blocking, a request whose adapter would be one too many), and prefix-cache hashes keep
adapters apart."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner

LORAS = [None, *(LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3))]


def _req(rid: str, lora: LoRARequest | None, n: int = 6) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    return Request(rid, list(range(1, n + 1)), sp, eos_token_id=None, lora_request=lora)


def test_at_most_max_loras_adapters_run_at_once() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=64, max_loras=2),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64)
    order = [LORAS[1], LORAS[2], LORAS[3], None, LORAS[1]]
    for i, lora in enumerate(order):
        s.add_request(_req(f"r{i}", lora))
    runner = FakeRunner()
    first = s.schedule()
    # r2 (a third adapter) is skipped; the base request and a1's second one behind it run.
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    seen_max = 0
    so = first
    while True:
        ids = {s.requests[r].lora_request.lora_int_id for r in so.num_scheduled_tokens
               if r in s.requests and s.requests[r].lora_request is not None}
        running = {r.lora_request.lora_int_id for r in s.running if r.lora_request}
        seen_max = max(seen_max, len(ids), len(running))
        s.update_from_output(so, runner.execute_model(so))
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
    assert seen_max == 2


def test_block_hashes_include_the_adapter() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True)
    reqs = [_req(f"h{i}", lora, n=9) for i, lora in enumerate([None, LORAS[1], LORAS[2]])]
    hashes = [kv._block_hashes(r, 2) for r in reqs]
    assert len({h[0] for h in hashes}) == 3 and len({h[1] for h in hashes}) == 3
    again = _req("h9", LoRARequest("other-name", 1, "/a1"), n=9)
    assert kv._block_hashes(again, 2) == hashes[1]  # the id decides, not the name
