"""The offline API on the real default model: validation, sampling, stop strings, n > 1,
logprobs, prompt logprobs, and the CLI's one-line errors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.input_processor import ContextLengthError

PROMPT = "The three most popular programming languages are"


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
def test_sampling_params_validate(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_child_seeds_stay_int64():
    """Sample i of an n > 1 request is seeded seed + i, wrapped into int64 (2^63 - 1
    with n=2 overflowed the core's generator before)."""
    from pagedllm.sampling_params import SEED_MAX, SEED_MIN, child_seed

    assert child_seed(5, 3) == 8
    assert child_seed(SEED_MAX, 1) == SEED_MIN
    assert child_seed(SEED_MIN, 0) == SEED_MIN
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        for i in range(4):
            assert SEED_MIN <= child_seed(seed, i) <= SEED_MAX
            SamplingParams(seed=child_seed(seed, i))


def test_bad_requests_raise_and_queue_nothing(llm):
    vocab = llm.llm_engine.config.model_config.vocab_size
    with pytest.raises(ContextLengthError, match="1024"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1020), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[1, 2, vocab]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # A bad prompt in a batch: nothing of the batch was queued.
    with pytest.raises(ValueError):
        llm.generate([PROMPT, [vocab + 5]], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    core = llm.llm_engine.client.core
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_usable_blocks
    # The engine still works.
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_unknown_engine_arg_and_missing_model():
    from pagedllm import LLM

    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/model/dir")


def test_seeded_sampling_is_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    (alone,) = llm.generate([PROMPT], sp, use_tqdm=False)
    others = SamplingParams(temperature=0.7, max_tokens=20)
    outs = llm.generate(["Hello there", PROMPT, "Count: 1, 2,"], [others, sp, others],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_samples_and_logprobs(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2)
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and 2 <= len(pos) <= 3
            assert all(lp.logprob <= 0.0 for lp in pos.values())
            total += pos[tok].logprob
        assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-5, abs_tol=1e-5)


def test_prompt_logprobs(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], plp[1:]):
        assert tok in pos


def test_stop_string_and_include(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[6:10]  # a stop string that likely spans a token boundary
    assert stop.strip()
    (cut,) = llm.generate([PROMPT], greedy.clone(stop=[stop]), use_tqdm=False)
    c = cut.outputs[0]
    assert c.text == text[:text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    (inc,) = llm.generate([PROMPT], greedy.clone(stop=[stop], include_stop_str_in_output=True),
                          use_tqdm=False)
    assert inc.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_chat_uses_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "Say hello."}],
                      SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)
    assert out.outputs[0].text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_chat_with_tools_on_a_template_without_them(llm):
    """The default model's template reads no ``tools``: as on the server, the tools go
    into the system message (the prompt fallback) and the reply is text."""
    params = SamplingParams(temperature=0, max_tokens=4)
    (out,) = llm.chat(MSGS, params, use_tqdm=False, tools=[WEATHER])
    (plain,) = llm.chat(MSGS, params, use_tqdm=False)
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.index("get_weather") < text.index("What is the weather in Paris?")
    assert "get_weather" not in llm.get_tokenizer().decode(plain.prompt_token_ids)


def test_chat_with_tools_on_a_template_that_reads_them(llm):
    """A template with a ``tools`` variable gets the tools there, unchanged; template
    variables of the caller's pass through ``chat_template_kwargs``."""
    template = ("{% for t in tools %}TOOL={{ t.function.name }};{% endfor %}"
                "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    (out,) = llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                      chat_template=template, tools=[WEATHER],
                      chat_template_kwargs={"greeting": "HELLO;"})
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text.startswith("TOOL=get_weather;HELLO;What is the weather")


@pytest.mark.parametrize("tools", ["get_weather", [{"type": "function"}],
                                   [{"type": "function", "function": {
                                       "name": "f", "parameters": "not a schema"}}]])
def test_chat_with_bad_tools_names_them(llm, tools):
    with pytest.raises(ValueError, match="tools"):
        llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False, tools=tools)
    (ok,) = llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert ok.outputs[0].token_ids  # the engine still answers


def test_throughput_policy_gives_fcfs_greedy_outputs(llm):
    """The offline API's default policy is FCFS on the CPU (the session engine) and
    throughput on CUDA.  Longest-first order and paced (chunked) prefill change when
    tokens are computed, never which: greedy outputs equal FCFS's."""
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import offline_scheduling_policy

    assert llm.llm_engine.config.scheduler_config.policy == "fcfs"
    assert offline_scheduling_policy("cpu") == "fcfs"
    assert offline_scheduling_policy("cuda") == "throughput"
    prompts = [PROMPT, "Hello there, how are you today? I am", "Count: 1, 2,",
               "The capital of France is a city that"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (4, 16, 8, 12)]
    thr = LLM(kv_cache_memory_bytes=16 << 20, max_model_len=256,
              max_num_batched_tokens=256, scheduling_policy="throughput",
              quantization="none")
    assert thr.llm_engine.config.scheduler_config.policy == "throughput"
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in thr.generate(prompts, params, use_tqdm=False)]
    assert got == want and [len(t) for t in got] == [4, 16, 8, 12]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_errors_are_one_line():
    r = _cli("generate", "hi", "--temperature", "-1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: temperature")
    assert "Traceback" not in r.stderr
    r = _cli("generate", "hi", "--model", "/nonexistent.gguf")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "model" in r.stderr.strip().splitlines()[-1]
    r = _cli("generate", "hi", "--model-loader-extra-config", "{bad")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--model-loader-extra-config" in r.stderr.strip().splitlines()[-1]


def test_cli_serve_without_server_dependencies():
    """Where uvicorn is not installed (emulated by refusing its import), ``pagedllm
    serve`` still exists and says in one line what is missing, instead of argparse's
    "invalid choice"."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'uvicorn':\n"
        "            raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from pagedllm.entrypoints.cli import main\n"
        "sys.exit(main(['serve', '--model', 'whatever', '--port', '1']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "invalid choice" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pagedllm serve") and "uvicorn" in last
