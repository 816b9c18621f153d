"""User inputs -> PIL images: ``multi_modal_data`` of a prompt dict (vLLM's shape) and the
image parts of OpenAI chat messages.

Every rejection is a ``ValueError`` naming the field (``multi_modal_data``,
``image_url``...).  Image bytes never reach a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from pagedllm.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, decode_image, parse_data_url


def images_of(multi_modal_data: Any) -> list[Image.Image]:
    """The images of a prompt's ``multi_modal_data`` (``{"image": img | [img, ...]}``)."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}, got "
                         f"{type(multi_modal_data).__name__}")
    unknown = set(multi_modal_data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modality {sorted(unknown)!r} "
                         "(supported: image)")
    value = multi_modal_data.get("image")
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, im in enumerate(items):
        if not isinstance(im, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, "
                             f"got {type(im).__name__}")
    return [_rgb(im, "multi_modal_data['image']") for im in items]


def _rgb(im: Image.Image, field: str) -> Image.Image:
    """Decode fully now (a truncated file fails here, naming ``field``), in RGB."""
    try:
        im.load()
        return im if im.mode == "RGB" else im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{field}: cannot decode the image ({type(e).__name__})") from None


def decode_data_url(url: str, field: str = "image_url") -> Image.Image:
    """A ``data:image/...;base64,...`` URL -> RGB image (``multimodal/media.py``'s
    bounds: byte and pixel caps, known formats).  Offline chat reads no ``http(s)`` or
    ``file`` URLs (the server's ``MediaLoader`` does)."""
    if not url.startswith("data:"):
        raise ValueError(f"{field}: offline chat takes data URLs "
                         "('data:image/png;base64,...') or 'image_pil' parts")
    return decode_image(parse_data_url(url, field, DEFAULT_MAX_IMAGE_BYTES), field)


def split_chat_images(messages: Sequence[Mapping[str, Any]],
                      ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Chat messages whose image parts (``image_url`` with a data URL, ``image_pil``,
    ``image`` with a PIL image) are replaced by ``{"type": "image"}`` -- what chat
    templates render as the image token -- and the images in order."""
    out: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ValueError("messages: each message must be a dict")
        content = m.get("content")
        if isinstance(content, str) or content is None:
            out.append(dict(m))
            continue
        if not isinstance(content, Sequence):
            raise ValueError("messages: content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for p in content:
            kind = p.get("type") if isinstance(p, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": p.get("text", "")})
                continue
            if kind == "image_url":
                iu = p.get("image_url")
                url = iu.get("url") if isinstance(iu, Mapping) else iu
                if not isinstance(url, str):
                    raise ValueError("image_url: expected {'url': 'data:image/...'}")
                images.append(decode_data_url(url))
            elif kind in ("image_pil", "image"):
                im = p.get(kind)
                if not isinstance(im, Image.Image):
                    raise ValueError(f"{kind}: expected a PIL.Image.Image, got "
                                     f"{type(im).__name__}")
                images.append(_rgb(im, kind))
            else:
                raise ValueError(f"messages: unsupported content part type {kind!r} "
                                 "(text, image_url, image_pil)")
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images
