"""The chat page at ``/`` in a real headless Chromium (Playwright), against real servers.

Load it, pick the model, send a message and watch the reply stream in (it must equal the
API's own greedy reply), stop a long reply mid-stream (the server counts an abort), and
with ``--api-key`` enter the key before anything works.  ``--no-ui`` leaves ``/`` 404.
Skipped, with the reason, only where no Chromium is installed (CI installs Debian's
``chromium`` in ``.ci/run``).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import ServerProcess, running_server, wait_until

CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "SmolLM2-135M-Instruct"
ABORTS = 'vllm:request_success_total{finished_reason="abort"}'

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium browser at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser, url: str):  # type: ignore[no-untyped-def]
    page = browser.new_page()
    foreign: list[str] = []
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(url) else None)
    page.goto(url + "/")
    return page, foreign


def _send(page, text: str, max_tokens: int, temperature: float) -> None:  # type: ignore[no-untyped-def]
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", text)
    page.click("#send")


def test_chat_streams_the_api_reply(browser, server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    page, foreign = _open(browser, server.url)
    page.wait_for_function("() => document.querySelector('#model').value !== ''")
    assert page.input_value("#model") == MODEL
    # Count the reply's DOM updates: streamed text arrives in several of them.
    page.evaluate("""() => { window.__updates = 0;
        new MutationObserver(() => window.__updates++).observe(
            document.querySelector('#messages'),
            {subtree: true, childList: true, characterData: true}); }""")
    _send(page, "Name three colours.", max_tokens=24, temperature=0)
    page.wait_for_selector(".msg.assistant[data-finish]", timeout=120_000)
    reply = page.inner_text(".msg.assistant .content")
    expected = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").chat.completions \
        .create(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=24, temperature=0, top_p=1).choices[0].message.content
    assert reply == expected and reply
    assert page.evaluate("window.__updates") >= 5
    assert page.get_attribute(".msg.assistant", "data-finish") == "length"
    stats = page.inner_text("#stats")
    assert "24 tokens generated" in stats and "tok/s" in stats and "prompt " in stats
    assert not page.is_disabled("#send") and page.is_disabled("#stop")
    assert not foreign, f"the page requested other origins: {foreign}"
    page.close()


def test_page_loads_without_404s_and_counts_one_token(browser, server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    """No request of the page fails (the favicon is served) and a one-token reply says
    "1 token", not "1 tokens" (issue 46 item 20)."""
    page = browser.new_page()
    failed: list[str] = []
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
    page.goto(server.url + "/")
    page.wait_for_function("() => document.querySelector('#model').value !== ''")
    icon = httpx.get(server.url + "/ui/favicon.svg")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    _send(page, "Hi", max_tokens=1, temperature=0)
    page.wait_for_selector(".msg.assistant[data-finish]", timeout=120_000)
    stats = page.inner_text("#stats")
    assert "· 1 token generated" in stats and not re.search(r"\b1 tokens", stats), stats
    assert not failed, failed
    page.close()


def test_stop_mid_stream(browser, paced_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    """Stop aborts the stream in the engine (paced: its 200 tokens take at least 10 s)."""
    server = paced_server
    before = server.metrics().get(ABORTS, 0)
    page, _ = _open(browser, server.url)
    page.wait_for_function("() => document.querySelector('#model').value !== ''")
    _send(page, "Tell me a long story about a dragon.", max_tokens=200, temperature=0.8)
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .content').textContent.length > 10",
        timeout=120_000)
    assert not page.is_disabled("#stop")
    page.click("#stop")
    page.wait_for_selector('.msg.assistant[data-finish="stopped"]', timeout=30_000)
    assert not page.is_disabled("#send") and page.is_disabled("#stop")
    assert "finish: stopped" in page.inner_text("#stats")
    # The disconnect aborted the request in the engine, before its 200 tokens.
    assert wait_until(lambda: server.metrics().get(ABORTS, 0) == before + 1)
    assert wait_until(lambda: server.metrics().get("vllm:num_requests_running") == 0)
    page.close()


@pytest.fixture(scope="module")
def key_server() -> Iterator[ServerProcess]:
    with running_server("--api-key", "sk-ui-test") as s:
        yield s


def test_api_key_is_asked_for(browser, key_server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    assert httpx.get(key_server.url + "/v1/models").status_code == 401
    page, _ = _open(browser, key_server.url)
    page.wait_for_selector("#key-box:not([hidden])")
    assert page.input_value("#model") == ""
    page.fill("#api-key", "sk-ui-test")
    page.click("#key-save")
    page.wait_for_function("() => document.querySelector('#model').value !== ''")
    _send(page, "Hi", max_tokens=3, temperature=0)
    page.wait_for_selector(".msg.assistant[data-finish]", timeout=120_000)
    assert page.get_attribute(".msg.assistant", "data-finish") == "length"
    page.close()


def test_no_ui(server: ServerProcess) -> None:
    # The flag is checked in-process on the real app (a second server costs a model load).
    from pagedllm.entrypoints.openai.api_server import build_app

    state = server  # the shared server is the one with the page on
    assert httpx.get(state.url + "/").status_code == 200
    assert "text/javascript" in httpx.get(state.url + "/ui/chat.js").headers["content-type"]
    from pagedllm.entrypoints.openai.serving_base import ServingState
    from pagedllm.metrics import EngineMetrics

    app = build_app(ServingState(engine=None, metrics=EngineMetrics("m"),  # type: ignore[arg-type]
                                 served_model_names=["m"], max_model_len=1), ui=False)
    paths = {getattr(r, "path", "") for r in app.routes}
    assert "/" not in paths and "/ui/chat.js" not in paths and "/v1/models" in paths
