"""Issue 46 item 4: a file a client or a flag names is opened only when it is a regular
file of bounded size (``model_files/safe_open.py``).  A FIFO as ``adapter_config.json``
used to block the API server's one tokenizer thread -- every text request hung while
``/health`` said 200; now the load is a 400 at once and text requests still complete."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedllm.model_files.safe_open import UnsafeFileError, open_regular, read_regular
from tests.server.harness import ServerProcess, running_server

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
          "bias": "none"}


def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    for path in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(UnsafeFileError, match="not a regular file"):
            open_regular(path, "rb")
    assert time.monotonic() - t0 < 1  # nothing waited for a writer
    ok = tmp_path / "ok.json"
    ok.write_text('{"a": 1}')
    with open_regular(ok, encoding="utf-8") as f:
        assert json.load(f) == {"a": 1}
    assert read_regular(ok, max_bytes=8) == '{"a": 1}'
    with pytest.raises(UnsafeFileError, match="allowed"):
        read_regular(ok, max_bytes=7)
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")


@pytest.fixture(scope="module")
def lora_server() -> Iterator[ServerProcess]:
    with running_server("--enable-lora", "--max-lora-rank", "8", "--quantization", "none",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s


def test_fifo_adapter_files_are_400_and_text_requests_still_complete(
        lora_server: ServerProcess, tmp_path) -> None:
    s = lora_server
    fifo_cfg = tmp_path / "fifo_config"
    fifo_cfg.mkdir()
    os.mkfifo(fifo_cfg / "adapter_config.json")
    fifo_weights = tmp_path / "fifo_weights"
    fifo_weights.mkdir()
    (fifo_weights / "adapter_config.json").write_text(json.dumps(CONFIG))
    os.mkfifo(fifo_weights / "adapter_model.safetensors")
    dir_cfg = tmp_path / "dir_config"
    (dir_cfg / "adapter_config.json").mkdir(parents=True)
    for name, path in (("f1", fifo_cfg), ("f2", fifo_weights), ("f3", dir_cfg)):
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/load_lora_adapter", timeout=30,
                       json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        assert "not a regular file" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10
    # The tokenizer thread is free: text requests (tokenised there) complete.
    r = httpx.post(s.url + "/v1/completions", timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    assert "f1" not in httpx.get(s.url + "/v1/models", timeout=10).text
