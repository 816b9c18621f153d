"""The CLI as a new user meets it: real ``pagedllm`` subprocesses on the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm.entrypoints.cli import build_parser, finish_notes, merge_model_tag
from pagedllm.sampling_params import SamplingParams


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_says_when_the_output_is_cut() -> None:
    r = _cli("generate", "The capital of France is", "--max-tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "finish_reason=length" in r.stderr and "--max-tokens 3" in r.stderr
    assert "--chat" in r.stderr  # SmolLM2-Instruct has a chat template
    # Our own config code triggers no transformers deprecation warning.
    assert "torch_dtype" not in r.stderr


def test_chat_says_when_a_reply_is_cut() -> None:
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "chat",
                        "--max-tokens", "3", "--temperature", "0", "--max-model-len", "256"],
                       input="Tell me a long story about a cat.\n", capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "reply cut at --max-tokens 3 (finish_reason=length)" in r.stderr


def test_help_shows_zero_defaults() -> None:
    """0 and 0.0 equal False, yet they are defaults to show (temperature, min-p)."""
    r = _cli("generate", "--help", timeout=120)
    text = " ".join(r.stdout.split())
    assert "0 = greedy; higher = more random. (default: 0.0)" in text
    assert "top probability. (default: 0.0)" in text


def test_generate_notes_for_an_empty_output(llm) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    (full,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    first = llm.get_tokenizer().decode(full.outputs[0].token_ids[:1])
    assert first.strip()
    (cut,) = llm.generate(["The capital of France is"], greedy.clone(stop=[first.strip()]),
                          use_tqdm=False)
    c = cut.outputs[0]
    assert c.text.strip() == "" and c.finish_reason == "stop"
    notes = finish_notes(c, 2, chat=False, has_chat_template=True)
    assert "output is empty" in notes[0] and "finish_reason=stop" in notes[0]
    assert repr(first.strip()) in notes[0]
    assert "--chat" in notes[1]
    assert len(finish_notes(c, 2, chat=True, has_chat_template=True)) == 1
    assert full.outputs[0].finish_reason == "length"
    (note,) = finish_notes(full.outputs[0], 2, chat=True, has_chat_template=True)
    assert "cut at --max-tokens 2" in note


def test_help_shows_defaults() -> None:
    r = _cli("serve", "--help", timeout=120)
    assert r.returncode == 0
    assert "(default: 8000)" in r.stdout and "(default: 16)" in r.stdout
    assert "(default: None)" not in r.stdout
    r = _cli("bench", "throughput", "--help", timeout=120)
    assert "docs/benchmarks.md" in r.stdout and "BENCHMARKS.md" not in r.stdout.replace(
        "docs/benchmarks.md", "")


def test_serve_takes_the_model_positionally() -> None:
    args = build_parser().parse_args(["serve", "--port", "0", "some/model.gguf",
                                      "--max-model-len", "64"])
    merge_model_tag(args)
    assert args.model == "some/model.gguf" and args.max_model_len == 64
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(ValueError, match="model: given twice"):
        merge_model_tag(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("text,want", [("12000000000", 12 * 10**9), ("12e9", 12 * 10**9),
                                       ("1.5g", 15 * 10**8), ("2G", 2 * 2**30),
                                       ("512M", 512 * 2**20)])
def test_kv_cache_memory_bytes_takes_vllm_size_notation(text: str, want: int) -> None:
    args = build_parser().parse_args(["bench", "multiturn", "--kv-cache-memory-bytes", text])
    assert args.kv_cache_memory_bytes == want


@pytest.mark.parametrize("text", ["lots", "1.5", "12x"])
def test_kv_cache_memory_bytes_refuses_other_text_naming_the_flag(text: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "multiturn", "--kv-cache-memory-bytes", text])
    assert e.value.code == 2 and "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_device_cuda_without_cuda_is_one_line() -> None:
    r = _cli("generate", "Hi", "--device", "cuda", "--max-tokens", "1", timeout=300)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: device: 'cuda'") and "CUDA" in lines[0]


def test_speculative_draft_model_missing_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = '{"model": "%s", "num_speculative_tokens": 4}' % (tmp_path / "missing")
    r = _cli("generate", "Hi", "--speculative-config", spec, "--max-tokens", "1",
             timeout=300)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: speculative_config: model: no such file")
