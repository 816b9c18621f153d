"""The scheduler's side of images (torch-free, fake runner): when each image is encoded
under the encoder budget, what the runner frees, progress with an image larger than the
budget, re-encoding after preemption, and prefix-cache keys that name the images."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner

IMG = 7  # the placeholder token id


def make(budget: int = 32, encoder: int = 0, caching: bool = False,
         num_blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                        max_num_encoder_input_tokens=encoder),
        CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks)


def image_request(rid: str, runs: list[tuple[int, int, str]], prompt_len: int,
                  max_tokens: int = 3) -> Request:
    """A prompt of ``prompt_len`` tokens with placeholder runs ``(offset, length, id)``."""
    ids = [100 + i for i in range(prompt_len)]
    for off, n, _ in runs:
        ids[off:off + n] = [IMG] * n
    r = Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True), None)
    r.mm_features = [MultiModalFeature("image", ident, off, n, {}) for off, n, ident in runs]
    return r


def drive(s: Scheduler) -> list:
    runner = FakeRunner()
    steps = []
    while s.has_unfinished_requests():
        so = s.schedule()
        steps.append(so)
        s.update_from_output(so, runner.execute_model(so))
        assert len(steps) < 200
    return steps


def test_chunk_is_cut_at_an_image_the_budget_cannot_take():
    s = make(budget=64, encoder=40)
    s.add_request(image_request("r", [(2, 30, "A"), (32, 30, "B")], 70))
    steps = drive(s)
    first, second = steps[0], steps[1]
    assert first.scheduled_encoder_inputs == {"r": [0]}
    assert first.num_scheduled_tokens["r"] == 32  # cut at B's start
    assert first.free_encoder_inputs == {"r": [0]}
    assert second.scheduled_encoder_inputs == {"r": [1]}
    assert second.free_encoder_inputs == {"r": [1]}
    assert all(not so.scheduled_encoder_inputs for so in steps[2:])


def test_image_larger_than_the_budget_is_encoded_once_and_split():
    s = make(budget=8, encoder=8)
    s.add_request(image_request("r", [(1, 20, "A")], 24))
    steps = drive(s)
    encodes = [so.scheduled_encoder_inputs for so in steps if so.scheduled_encoder_inputs]
    frees = [so.free_encoder_inputs for so in steps if so.free_encoder_inputs]
    assert encodes == [{"r": [0]}]  # once, in the step its run starts
    assert frees == [{"r": [0]}]  # after the step that computes its last placeholder
    assert steps[0].num_scheduled_tokens["r"] == 8  # the run spans three chunks


def test_a_second_image_waits_for_the_next_steps_budget():
    s = make(budget=64, encoder=30)
    s.add_request(image_request("a", [(0, 30, "A")], 34))
    s.add_request(image_request("b", [(0, 30, "B")], 34))
    steps = drive(s)
    assert steps[0].scheduled_encoder_inputs == {"a": [0]}
    assert "b" not in steps[0].num_scheduled_tokens
    assert steps[1].scheduled_encoder_inputs == {"b": [0]}


def test_preempted_request_encodes_again():
    s = make(budget=64, num_blocks=14)
    s.add_request(image_request("a", [(0, 20, "A")], 24, max_tokens=16))
    s.add_request(image_request("b", [(0, 20, "B")], 24, max_tokens=16))
    steps = drive(s)
    assert s.total_preemptions > 0
    encoded = [rid for so in steps for rid in so.scheduled_encoder_inputs]
    assert len(encoded) > 2 and set(encoded) == {"a", "b"}
    assert not s.encoder.encoded  # forgotten when finished


def test_prefix_keys_name_the_images():
    s = make(caching=True)
    a = image_request("a", [(4, 8, "A")], 20)
    b = image_request("b", [(4, 8, "B")], 20)
    a2 = image_request("a2", [(4, 8, "A")], 20)
    ha, hb, ha2 = (s.kv._block_hashes(r, 5) for r in (a, b, a2))
    assert ha[0] == hb[0]  # the block before the images
    assert ha[1] != hb[1] and ha[2] != hb[2] and ha[4] != hb[4]  # chained after them
    assert ha == ha2
