"""Images through every chat endpoint (``entrypoints/openai/chat_images.py``).

Bad input is a 400 naming the field and the server answers normally afterwards: an
image sent to the text-only default model (chat, Anthropic, Responses), a malformed
part; then, on a server running the tiny random LLaVA (tests/models/tiny_vlms.py): more
images than ``--limit-mm-per-prompt``, corrupt, truncated, unsupported (TIFF, SVG), over
the pixel cap, a URL that times out or sends too much (a real HTTP server on
127.0.0.1), ``file://`` outside ``--allowed-local-media-path`` and a symlink escaping it.
Good input through the real ``openai``, ``anthropic`` and ``langchain-openai`` clients
(data URL, http URL, base64 block, ``input_image``) answers with the greedy tokens of
offline ``LLM.chat`` on the same image.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.multimodal.media_server import media_server
from tests.server.harness import ServerProcess, running_server

pytestmark = pytest.mark.timeout(600)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_body(*parts: dict[str, Any], max_tokens: int = 4) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe the image"}, *parts]}],
        "max_tokens": max_tokens, "temperature": 0}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def assert_400(r: httpx.Response, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert "base64," not in r.text and "iVBOR" not in r.text  # no image bytes echoed


def assert_alive(c: httpx.Client) -> None:
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert c.get("/health").status_code == 200


# ---------------------------------------------------------------------- text-only model


def test_text_only_model_refuses_images_on_every_endpoint(server: ServerProcess) -> None:
    url = data_url(png(Image.new("RGB", (4, 4))))
    with server.client() as c:
        assert_400(c.post("/v1/chat/completions", json=chat_body(image_part(url))),
                   "messages.0.content.1", "does not take images")
        r = c.post("/v1/messages", json={"max_tokens": 4, "messages": [{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png",
                "data": url.split(",", 1)[1]}}, {"type": "text", "text": "what"}]}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.content.0"
        assert "does not take images" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what"},
            {"type": "input_image", "image_url": url}]}]})
        assert_400(r, "input.0.content.1", "does not take images")
        # Malformed parts are named too, whatever the model.
        assert_400(c.post("/v1/chat/completions", json=chat_body(
            {"type": "image_url", "image_url": 5})), "messages.0.content.1.image_url",
            "image_url must be")
        assert_400(c.post("/v1/chat/completions", json=chat_body(
            {"type": "image_url", "image_url": {"url": url, "detail": "huge"}})),
            "messages.0.content.1.image_url.detail", "detail")
        r = c.post("/v1/messages", json={"max_tokens": 4, "messages": [{
            "role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]})
        assert r.status_code == 400 and \
            r.json()["error"]["param"] == "messages.0.content.0.source", r.text
        assert_alive(c)


# ---------------------------------------------------------------------- tiny VLM server


def _llava_ready() -> bool:
    try:
        from pagedllm.models.registry import ARCHITECTURES
    except ImportError:
        return False
    return "LlavaForConditionalGeneration" in ARCHITECTURES


needs_vlm = pytest.mark.skipif(not _llava_ready(), reason="no LLaVA model in this tree yet")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.models.tiny_vlms import build_llava

    path = str(tmp_path_factory.mktemp("tiny-llava"))
    build_llava(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny_vlms import image

    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png(image(0)))
    (root / "secret.png").write_bytes(png(image(1)))
    (allowed / "escape.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def vlm_server(llava_dir: str, media_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
            "--model", llava_dir, "--dtype", "float32", "--max-model-len", "256",
            "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", str(media_dir / "allowed"),
            "--media-fetch-timeout", "1", "--max-image-bytes", str(1 << 20),
            "--max-image-pixels", str(1 << 20),
            "--max-image-pixels-per-request", str(1_500_000), "--enable-log-requests",
            base_args=["--max-num-seqs", "4"]) as s:
        yield s


@pytest.fixture(scope="module")
def http_images() -> Iterator[str]:
    from tests.models.tiny_vlms import image

    with media_server(png(image(2))) as base:
        yield base


def _noise_png(size: tuple[int, int]) -> bytes:
    return png(Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)))


@needs_vlm
def test_vlm_bad_images_are_400s(vlm_server: ServerProcess, media_dir: Path,
                                 http_images: str) -> None:
    from tests.models.tiny_vlms import image

    ok = data_url(png(image(0)))
    f = "messages.0.content.1.image_url.url"
    tiff = io.BytesIO()
    image(0).save(tiff, "TIFF")
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'
    bomb = io.BytesIO()
    Image.new("L", (2000, 2000)).save(bomb, "PNG")  # 4 MP of zeros, a few KB
    cases = [
        (chat_body(image_part(ok), image_part(ok), image_part(ok)),
         "messages.0.content.3", "--limit-mm-per-prompt"),
        (chat_body(image_part("data:image/png;base64,AAAAAAAAAAAAAAAA")), f,
         "supported format"),
        (chat_body(image_part(data_url(_noise_png((64, 64))[:-300]))), f,
         "cannot be decoded"),
        (chat_body(image_part(data_url(tiff.getvalue(), "image/tiff"))), f,
         "supported format"),
        (chat_body(image_part(data_url(svg, "image/svg+xml"))), f, "supported format"),
        (chat_body(image_part(data_url(bomb.getvalue()))), f, "--max-image-pixels"),
        (chat_body(image_part(f"{http_images}/sleep")), f, "--media-fetch-timeout"),
        (chat_body(image_part(f"{http_images}/big")), f, "--max-image-bytes"),
        (chat_body(image_part(f"file://{media_dir}/secret.png")), f,
         "outside the directory"),
        (chat_body(image_part(f"file://{media_dir}/allowed/../secret.png")), f,
         "outside the directory"),
        (chat_body(image_part(f"file://{media_dir}/allowed/escape.png")), f,
         "outside the directory"),
        (chat_body(image_part("gopher://x/y.png")), f, "data:, http(s):// or file://"),
    ]
    with vlm_server.client(timeout=60) as c:
        for body, param, words in cases:
            assert_400(c.post("/v1/chat/completions", json=body), param, words)
        # Two images under the per-image cap, over the per-request one together.
        big = io.BytesIO()
        Image.new("L", (1000, 1000)).save(big, "PNG")
        r = c.post("/v1/chat/completions", json=chat_body(
            image_part(data_url(big.getvalue())), image_part(data_url(big.getvalue()))))
        assert r.status_code == 400 and "--max-image-pixels-per-request" in r.text, r.text
        assert r.json()["error"]["param"] in (f, "messages.0.content.2.image_url.url")
        r = c.post("/v1/messages", json={"max_tokens": 4, "messages": [{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "bm9wZQ=="}}]}]})
        assert r.status_code == 400 and \
            r.json()["error"]["param"] == "messages.0.content.0.source.data", r.text
        r = c.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": f"{http_images}/404"}]}]})
        assert_400(r, "input.0.content.0.image_url", "HTTP 404")
        # The server still answers, with and without images.
        assert_alive(c)
        r = c.post("/v1/chat/completions", json=chat_body(
            image_part(f"file://{media_dir}/allowed/ok.png")))
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json=chat_body(image_part(ok)))
        assert r.status_code == 200, r.text
    # Requests are logged (--enable-log-requests), their images never.
    log = vlm_server.log()
    assert "Received request" in log
    assert ok.split(",", 1)[1][:40] not in log and "base64," not in log


@needs_vlm
def test_vlm_clients_match_offline_chat(vlm_server: ServerProcess, llava_dir: str,
                                        http_images: str) -> None:
    import anthropic
    import openai
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    from pagedllm import LLM, SamplingParams
    from tests.models.tiny_vlms import image

    n = 8
    img0, img2 = image(0), image(2)  # http_images serves image(2)
    text = "describe the image"

    def offline(img: Image.Image) -> str:
        msgs = [{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(png(img))}}]}]
        llm = LLM(llava_dir, dtype="float32", max_model_len=256, max_num_seqs=2)
        try:
            out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=n),
                           use_tqdm=False)
        finally:
            llm.shutdown()
        return out[0].outputs[0].text

    want0, want2 = offline(img0), offline(img2)
    oa = openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="x", max_retries=0)
    got = oa.chat.completions.create(
        model=oa.models.list().data[0].id, max_tokens=n, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(png(img0))}}]}])
    assert got.choices[0].message.content == want0
    assert got.usage.prompt_tokens > 25  # the image's 25 placeholder tokens count
    chunks = oa.chat.completions.create(
        model=got.model, max_tokens=n, temperature=0, stream=True,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": data_url(png(img0))}]}])  # type: ignore
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want0
    got = oa.chat.completions.create(
        model=got.model, max_tokens=n, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": f"{http_images}/img.png"}}]}])
    assert got.choices[0].message.content == want2
    resp = oa.responses.create(model=got.model, max_output_tokens=n, temperature=0,
                               input=[{"role": "user", "content": [
                                   {"type": "input_text", "text": text},
                                   {"type": "input_image",
                                    "image_url": data_url(png(img0))}]}])
    assert resp.output_text == want0

    an = anthropic.Anthropic(base_url=vlm_server.url, api_key="x", max_retries=0)
    msg = an.messages.create(  # this SDK has no temperature argument: the body has it
        model=got.model, max_tokens=n, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(img0)).decode()}}]}])
    assert msg.content[0].text == want0

    lc = ChatOpenAI(base_url=vlm_server.url + "/v1", api_key="x", model=got.model,
                    max_tokens=n, temperature=0, max_retries=0)  # type: ignore[call-arg]
    out = lc.invoke([HumanMessage(content=[
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": data_url(png(img0))}}])])
    assert out.content == want0
