"""``entrypoints/openai/chat_images.py`` and the Responses store's image budget, without a
server: part shapes, translation from Anthropic / Responses shapes (errors name the
client's own field), the text-only and limit checks, and loading through ``media``."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from pagedllm.entrypoints.openai.chat_images import (
    ChatImages,
    anthropic_image_part,
    image_refs,
    responses_image_part,
    template_messages_with_images,
    with_pil_images,
)
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError
from pagedllm.entrypoints.openai.serving_responses import ResponseStore
from pagedllm.multimodal.media import MediaLoader


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _request(*parts: dict) -> ChatCompletionRequest:  # type: ignore[type-arg]
    return ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]})


def test_refs_and_template_messages() -> None:
    url = _png()
    body = _request({"type": "image_url", "image_url": url},
                    {"type": "image_url", "image_url": {"url": url, "detail": "low"}})
    refs = image_refs(body.messages)
    assert [(r.url_field, r.part_field) for r in refs] == [
        ("messages.1.content.1.image_url", "messages.1.content.1"),
        ("messages.1.content.2.image_url.url", "messages.1.content.2")]
    msgs = template_messages_with_images(body.messages)
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == [{"type": "text", "text": "look"}, {"type": "image"},
                                  {"type": "image"}]
    a, b = Image.new("RGB", (1, 1)), Image.new("RGB", (2, 2))
    pil = with_pil_images(msgs, [a, b])[1]["content"]
    assert pil[1]["image_pil"] is a and pil[2]["image_pil"] is b


@pytest.mark.parametrize("part,field", [
    ({"type": "image_url", "image_url": 5}, "messages.1.content.1.image_url"),
    ({"type": "image_url", "image_url": {"uri": "x"}}, "messages.1.content.1.image_url"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}},
     "messages.1.content.1.image_url.detail"),
])
def test_malformed_parts(part: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError) as ei:
        image_refs(_request(part).messages)
    assert ei.value.param == field


def test_translated_parts_name_their_own_fields() -> None:
    a = anthropic_image_part({"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}, "messages.0.content.2")
    r = responses_image_part({"type": "input_image", "image_url": "http://h/x.png"},
                             "input.1.content.0")
    refs = image_refs(_request(a, r).messages)
    assert refs[0].url == "data:image/png;base64,AAAA"
    assert (refs[0].url_field, refs[0].part_field) == ("messages.0.content.2.source.data",
                                                       "messages.0.content.2")
    assert (refs[1].url_field, refs[1].part_field) == ("input.1.content.0.image_url",
                                                       "input.1.content.0")
    for block, field in [({"source": {"type": "base64", "media_type": "text/plain",
                                      "data": "x"}}, "m.source.media_type"),
                         ({"source": {"type": "base64", "media_type": "image/png"}},
                          "m.source.data"),
                         ({"source": {"type": "url"}}, "m.source.url"),
                         ({"source": "x"}, "m.source")]:
        with pytest.raises(RequestError) as ei:
            anthropic_image_part(block, "m")
        assert ei.value.param == field
    with pytest.raises(RequestError) as ei:
        responses_image_part({"type": "input_image", "file_id": "f"}, "i")
    assert ei.value.param == "i.file_id"


def test_checks_and_loading() -> None:
    url = _png()
    refs = image_refs(_request(*[{"type": "image_url", "image_url": url}] * 3).messages)
    loader = MediaLoader()
    try:
        with pytest.raises(RequestError, match="does not take images") as ei:
            ChatImages(loader, False, None).check(refs, "m")
        assert ei.value.param == "messages.1.content.1"
        with pytest.raises(RequestError, match="--limit-mm-per-prompt") as ei:
            ChatImages(loader, True, 2).check(refs, "m")
        assert ei.value.param == "messages.1.content.3"
        intake = ChatImages(loader, True, 3)
        intake.check(refs, "m")
        images = asyncio.run(intake.load(refs))
        assert [im.size for im in images] == [(3, 2)] * 3
        bad = image_refs(_request({"type": "image_url", "image_url": url},
                                  {"type": "image_url", "image_url": "data:x"}).messages)
        with pytest.raises(RequestError) as ei:
            asyncio.run(intake.load(bad))
        assert ei.value.param == "messages.1.content.2.image_url"
    finally:
        loader.close()


def test_response_store_bounds_image_bytes() -> None:
    store = ResponseStore(max_size=100, max_image_bytes=1000)
    img = {"role": "user", "content": [{"type": "image_url",
                                        "image_url": {"url": "d" * 400}}]}
    for i in range(5):
        store.put(f"r{i}", [img], {"id": f"r{i}"})
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False] * 3 + [True] * 2
    store.put("text", [{"role": "user", "content": "hi"}], {"id": "text"})
    assert store.get("r4") is not None and store.get("text") is not None
