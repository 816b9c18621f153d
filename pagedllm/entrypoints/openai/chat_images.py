"""Images in chat requests: the content parts that carry them, on every chat endpoint.

Shapes accepted (docs/server.md, "Images"):

* Chat Completions: ``{"type": "image_url", "image_url": "URL" | {"url": "URL",
  "detail": "auto" | "low" | "high"}}`` (``detail`` is accepted and ignored);
* Anthropic ``/v1/messages``: ``{"type": "image", "source": {"type": "base64",
  "media_type": "image/png", "data": "..."} | {"type": "url", "url": "URL"}}``;
* Responses ``/v1/responses``: ``{"type": "input_image", "image_url": "URL"}``.

The Anthropic and Responses shapes are translated into the chat one
(``anthropic_image_part``, ``responses_image_part``); the part keeps the fields it came
from (``FIELD_KEY``, ``URL_FIELD_KEY``) so an error names the client's own field.
``ChatImages.load`` then, for one chat request, before anything is tokenised:

1. finds every image part and checks its shape (400 naming the field);
2. refuses any image when the model takes none (400 naming the first image part), and
   more images than ``--limit-mm-per-prompt`` allows (400 naming the first one over);
3. loads them all concurrently (``multimodal.media``: data/http/file URLs under the
   server's byte, pixel and time bounds; 400 naming the URL's field).

The messages handed to the chat template then hold ``{"type": "image"}`` parts where the
images were, as offline ``LLM.chat`` renders them, and the images travel to the engine as
``multi_modal_data`` in message order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.request_error import RequestError
from pagedllm.multimodal.media import MediaError, MediaLoader

# The keys under which a translated part remembers the client's fields (for errors):
# the part (block) itself and the field holding its URL or data.
FIELD_KEY, URL_FIELD_KEY = "_pagedllm_field", "_pagedllm_url_field"
_DETAILS = ("auto", "low", "high")
# Images of one request fetched and decoded at once (a 999-image request must not
# open 999 connections; the decode pool bounds the CPU).
MAX_CONCURRENT_LOADS = 4


@dataclass(frozen=True)
class ImageRef:
    """One image part of a chat request: its URL, the field holding the URL (for load
    errors) and the part's own path (for "not here" errors)."""

    url: Any
    url_field: str
    part_field: str


def image_refs(messages: list[Any]) -> list[ImageRef]:
    """The image parts of chat ``messages`` (``ChatMessage``s), in order; 400 naming
    the field for a malformed one."""
    refs: list[ImageRef] = []
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, list):
            continue
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "image_url":
                continue
            where = str(p.get(FIELD_KEY) or f"messages.{i}.content.{j}")
            iu = p.get("image_url")
            if FIELD_KEY in p:  # translated (Anthropic, Responses): their field names
                refs.append(ImageRef(iu.get("url") if isinstance(iu, dict) else iu,
                                     str(p.get(URL_FIELD_KEY) or where), where))
                continue
            if isinstance(iu, str):
                refs.append(ImageRef(iu, f"{where}.image_url", where))
                continue
            if not isinstance(iu, dict) or not isinstance(iu.get("url"), str):
                raise RequestError('image_url must be a URL string or {"url": "..."}',
                                   f"{where}.image_url")
            detail = iu.get("detail")
            if detail is not None and detail not in _DETAILS:
                raise RequestError('detail must be "auto", "low" or "high"',
                                   f"{where}.image_url.detail")
            refs.append(ImageRef(iu["url"], f"{where}.image_url.url", where))
    return refs


def template_content(content: list[Any]) -> list[dict[str, Any]]:
    """A message's parts as the chat template sees them: text parts, and
    ``{"type": "image"}`` where an image was.  Other parts are refused (400)."""
    out: list[dict[str, Any]] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            out.append({"type": "image"})
        else:
            raise RequestError(f"content parts of type {kind!r} are not supported "
                               "(text and image_url)", "messages")
    return out


def model_takes_images(engine_config: Any) -> bool:
    """Whether the served model reads images (the engine built it a multimodal config:
    a vision tower beside the text decoder)."""
    return getattr(engine_config.model_config, "multimodal_config", None) is not None


def image_limit(engine_config: Any, default: int | None = None) -> int | None:
    """``--limit-mm-per-prompt``'s image count, wherever the engine config keeps it
    (None: no limit known here; the engine still checks)."""
    for owner in (engine_config, getattr(engine_config, "model_config", None)):
        for name in ("multimodal_config", "mm_config"):
            mm = getattr(owner, name, None)
            limits = getattr(mm, "limit_per_prompt", None)
            if isinstance(limits, dict) and isinstance(limits.get("image"), int):
                return int(limits["image"])
    return default


@dataclass
class ChatImages:
    """The server's image intake: one per server (``ServingState.images``)."""

    loader: MediaLoader
    takes_images: bool
    limit: int | None

    def check(self, refs: list[ImageRef], model_name: str) -> None:
        """400 for images the model or the limit cannot take (before any is loaded)."""
        if not refs:
            return
        if not self.takes_images:
            raise RequestError(f"the model {model_name!r} does not take images (it is a "
                               "text-only model)", refs[0].part_field)
        if self.limit is not None and len(refs) > self.limit:
            raise RequestError(
                f"the request has {len(refs)} images, more than the {self.limit} allowed "
                "per prompt (--limit-mm-per-prompt)", refs[self.limit].part_field)

    async def load(self, refs: list[ImageRef]) -> list[Any]:
        """The images of ``refs``, loaded ``MAX_CONCURRENT_LOADS`` at a time (400
        naming the first bad one's field; the others are cancelled)."""
        gate = asyncio.Semaphore(MAX_CONCURRENT_LOADS)
        budget = self.loader.request_budget()  # all the request's pixels, bounded

        async def one(r: ImageRef) -> Any:
            async with gate:
                return await self.loader.load_image(r.url, r.url_field, budget)

        tasks = [asyncio.ensure_future(one(r)) for r in refs]
        try:
            return list(await asyncio.gather(*tasks))
        except MediaError as e:
            raise RequestError(str(e), e.param) from None
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        self.loader.close()


# ----------------------------------------------------------------------------- translation


def anthropic_image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic ``image`` block (at ``where``) as a chat ``image_url`` part."""
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        mt, data = src.get("media_type"), src.get("data")  # type: ignore[union-attr]
        if not isinstance(mt, str) or not mt.startswith("image/"):
            raise RequestError("media_type must be an image type such as image/png",
                               f"{where}.source.media_type")
        if not isinstance(data, str) or not data:
            raise RequestError("data must be a non-empty base64 string",
                               f"{where}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{mt};base64,{data}"},
                FIELD_KEY: where, URL_FIELD_KEY: f"{where}.source.data"}
    if kind == "url":
        url = src.get("url")  # type: ignore[union-attr]
        if not isinstance(url, str) or not url:
            raise RequestError("url must be a non-empty string", f"{where}.source.url")
        return {"type": "image_url", "image_url": {"url": url},
                FIELD_KEY: where, URL_FIELD_KEY: f"{where}.source.url"}
    raise RequestError('source must be {"type": "base64", "media_type", "data"} or '
                       '{"type": "url", "url"}', f"{where}.source")


def responses_image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses ``input_image`` part (at ``where``) as a chat ``image_url`` part."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        field = f"{where}.file_id" if part.get("file_id") is not None else \
            f"{where}.image_url"
        raise RequestError("input_image needs image_url (a data: or http(s):// URL; "
                           "file_id is not supported)", field)
    detail = part.get("detail")
    if detail is not None and detail not in _DETAILS:
        raise RequestError('detail must be "auto", "low" or "high"', f"{where}.detail")
    return {"type": "image_url", "image_url": {"url": url},
            FIELD_KEY: where, URL_FIELD_KEY: f"{where}.image_url"}


def template_messages_with_images(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat ``messages`` (``ChatMessage``s) as plain dicts for the chat template: a
    message with images keeps its parts (``template_content``), others are flattened to
    text as for a text-only request."""
    out = []
    for m in messages:
        d: dict[str, Any] = dict(m.model_extra or {})
        content = m.content
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            d.update(role=m.role, content=template_content(content))
        else:
            d.update(role=m.role, content=m.text())
        out.append(d)
    return out


def intake(state: Any) -> ChatImages:
    """The server's ``ChatImages`` (``state.images``), made with the default bounds at
    first use when the server did not set one from its flags."""
    if state.images is None:
        cfg = state.engine.config
        state.images = ChatImages(MediaLoader(), model_takes_images(cfg), image_limit(cfg))
    return state.images  # type: ignore[no-any-return]


def from_args(args: Any, engine_config: Any) -> ChatImages:
    """The server's ``ChatImages`` from its flags (``cli_args``: ``--allowed-local-media-
    path``, ``--allowed-media-domains``, ``--media-fetch-timeout``, ``--max-image-bytes``,
    ``--max-image-pixels``); ``ValueError`` naming the flag."""
    from pagedllm.multimodal.media import MediaConfig

    domains = getattr(args, "allowed_media_domains", None)
    cfg = MediaConfig(
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        allowed_media_domains=tuple(domains) if domains else None,
        fetch_timeout=getattr(args, "media_fetch_timeout", None) or MediaConfig.fetch_timeout,
        max_image_bytes=getattr(args, "max_image_bytes", None) or MediaConfig.max_image_bytes,
        max_image_pixels=getattr(args, "max_image_pixels", None)
        or MediaConfig.max_image_pixels,
        max_request_pixels=getattr(args, "max_image_pixels_per_request", None)
        or MediaConfig.max_request_pixels)
    return ChatImages(MediaLoader(cfg), model_takes_images(engine_config),
                      image_limit(engine_config))


def chat_prompt_ids(ip: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The prompt ids of a conversation with images, each image's placeholder run
    expanded by the model's processor, as offline ``LLM.chat`` makes them
    (``InputProcessor.chat_prompt``, whether it returns the ids or the rendered text
    for ``process`` to expand).  Runs on the tokenizer thread."""
    prompt = ip.chat_prompt(messages, **kwargs)
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    ids, _ = ip.mm.process(prompt["prompt"], prompt["multi_modal_data"]["image"],
                           add_special_tokens=bool(prompt.get("add_special_tokens", True)))
    return list(ids)


def with_pil_images(messages: list[dict[str, Any]], images: list[Any]
                    ) -> list[dict[str, Any]]:
    """Template messages whose ``{"type": "image"}`` parts carry the loaded images, in
    order (``{"type": "image_pil", "image_pil": img}``: what offline ``LLM.chat`` and
    ``InputProcessor.chat_prompt`` take)."""
    it = iter(images)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image_pil", "image_pil": next(it)}
                                  if p.get("type") == "image" else p for p in content]}
        out.append(m)
    return out
