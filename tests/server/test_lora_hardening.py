"""LoRA on the default model as it runs by default -- the GGUF's Q4_1 weights kept
quantised (issue 46 item 1: the slots once took a packed weight's uint8 dtype and the
first adapter request killed the engine) -- and bad adapters refused at load time."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.lora.fixtures import make_adapters
from tests.server.harness import running_server

PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378]
N = 6
SPECS = [("good", 8, 16, False, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"])]


@pytest.fixture(scope="module")
def quantised_lora(tmp_path_factory, hf_default_model) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("lora-q")
    (good,) = make_adapters(hf_default_model, str(root), SPECS, seed=3, scale=0.05,
                            merge=False)
    with running_server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"good={good.path}",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s, root, good.path


def _complete(s, model: str) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0})


def _alive(s) -> None:
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    r = _complete(s, "good")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_adapter_on_quantised_weights(quantised_lora) -> None:
    s, _, _ = quantised_lora
    base = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = _complete(s, "good")
    assert r.status_code == 200, r.text
    tuned = r.json()["choices"][0]
    plain = _complete(s, base).json()["choices"][0]
    assert tuned["text"] != plain["text"]  # the delta rides on the quantised output
    _alive(s)
