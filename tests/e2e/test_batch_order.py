"""The runner's longest-context-first layout of a step (``ModelRunner.sort_batch``, on by
default on CUDA) changes nothing observable: on the default model on CPU, with it forced
on, greedy and seeded outputs equal the scheduler's order, also with mixed prompt chunks
and decodes in one step, preemption and async scheduling."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,", "The capital of France is", "Write a haiku:"]
BYTES_PER_BLOCK = 16 * 2 * 30 * 3 * 64 * 4  # fp32 KV of one 16-token block, SmolLM2-135M


def _run(sort_batch: bool, async_scheduling: bool = False) -> tuple[list, list, int, int]:
    # 9 usable blocks force preemptions; a 24-token budget mixes chunks and decodes.
    llm = LLM(kv_cache_memory_bytes=10 * BYTES_PER_BLOCK, max_model_len=128,
              max_num_batched_tokens=24, async_scheduling=async_scheduling)
    core = llm.llm_engine.client.core
    runner = core.worker.runner
    runner.sort_batch = sort_batch
    sorted_steps = 0
    prepare = runner.batch.prepare

    def spy(rows, num_computed, num_new):
        nonlocal sorted_steps
        ctx = num_computed + num_new
        if sort_batch and len(ctx) > 1 and (ctx[:-1] >= ctx[1:]).all() and ctx[0] > ctx[-1]:
            sorted_steps += 1
        return prepare(rows, num_computed, num_new)

    runner.batch.prepare = spy
    greedy = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                    for n in (40, 7, 33, 21, 48, 12)], use_tqdm=False)
    seeded = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=5, max_tokens=20),
                          use_tqdm=False)
    return ([o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in seeded],
            core.scheduler.total_preemptions, sorted_steps)


def test_longest_first_layout_equals_scheduler_order(default_model_path) -> None:
    base = _run(False)
    got = _run(True)
    assert got[0] == base[0]
    assert [len(t) for t in got[0]] == [40, 7, 33, 21, 48, 12]
    assert got[1] == base[1]
    assert got[2] > 0 and base[2] > 0  # both were preempted
    assert got[3] > 0  # the spy saw steps laid out longest context first
    got_async = _run(True, async_scheduling=True)
    assert got_async[:2] == base[:2] and got_async[3] > 0
