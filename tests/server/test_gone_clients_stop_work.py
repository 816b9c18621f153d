"""Issue 46 item 7 on a generative server: a completion with a long list of prompts whose
client leaves mid-tokenising stops tokenising (the API process goes idle) instead of
working through the rest for nobody, and the server answers at once."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.server.harness import ServerProcess


def test_completion_prompt_list_stops_tokenising_for_a_gone_client(
        server: ServerProcess) -> None:
    api = psutil.Process(server.proc.pid)
    text = "The quick brown fox jumps over the lazy dog. " * 150  # ~7 KB, ~1500 tokens
    # 2000 such prompts take seconds to tokenise (each is then too long: a 400 at the
    # end); the client gives up after 1 s.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": [text] * 2000, "max_tokens": 1})
    time.sleep(1.0)  # the next disconnect check comes within 16 prompts
    cpu0 = sum(api.cpu_times()[:2])
    time.sleep(2.0)
    busy = sum(api.cpu_times()[:2]) - cpu0
    assert busy < 0.5, f"the API process used {busy:.2f} s of CPU for a gone client"
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 200, r.text
