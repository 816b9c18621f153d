"""``pagedllm.multimodal.media``: every way an image URL can be bad is a ``MediaError``
naming the field, and good ones decode to the same RGB pixels (real Pillow, a real HTTP
server on loopback, real files and symlinks)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from pagedllm.multimodal.media import (
    MediaConfig,
    MediaError,
    MediaLoader,
    decode_image,
    parse_data_url,
)
from tests.multimodal.media_server import media_server

F = "messages.0.content.1.image_url.url"


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), mode: str = "RGB",
                **kw: object) -> bytes:
    img = Image.new(mode, size)
    img.putdata([(x * 30 % 256, y * 40 % 256, 77)[:len(mode)] if mode != "L" else x
                 for y in range(size[1]) for x in range(size[0])])  # type: ignore[misc]
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(fmt: str, size: tuple[int, int] = (64, 64)) -> bytes:
    """An image that does not compress (so a cut one keeps its header)."""
    buf = io.BytesIO()
    Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(loader: MediaLoader, url: str) -> Image.Image:
    return asyncio.run(loader.load_image(url, F))


def refused(loader: MediaLoader, url: str, words: str) -> MediaError:
    with pytest.raises(MediaError) as ei:
        load(loader, url)
    assert ei.value.param == F and str(ei.value).startswith(F)
    assert words in str(ei.value), str(ei.value)
    return ei.value


@pytest.fixture
def loader() -> MediaLoader:
    ld = MediaLoader(MediaConfig(max_image_bytes=1 << 20, max_image_pixels=1 << 20,
                                 fetch_timeout=1.0))
    yield ld  # type: ignore[misc]
    ld.close()


# ---------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_supported_formats_decode_to_rgb(fmt: str) -> None:
    img = decode_image(image_bytes(fmt), F)
    assert img.mode == "RGB" and img.size == (8, 6)


def test_png_pixels_are_exact_and_alpha_goes_over_white() -> None:
    src = Image.open(io.BytesIO(image_bytes())).convert("RGB")
    assert decode_image(image_bytes(), F).tobytes() == src.tobytes()
    clear = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    buf = io.BytesIO()
    clear.save(buf, "PNG")
    assert set(decode_image(buf.getvalue(), F).tobytes()) == {255}


def test_gif_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    img = decode_image(buf.getvalue(), F)
    assert img.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("data,words", [
    (image_bytes("TIFF"), "supported format"),
    (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
     "supported format"),
    (b"not an image at all", "supported format"),
    (noise("PNG")[:-200], "cannot be decoded"),
    (noise("JPEG")[:-300], "truncated"),
])
def test_bad_image_data(data: bytes, words: str) -> None:
    with pytest.raises(MediaError, match=words) as ei:
        decode_image(data, F)
    assert ei.value.param == F


def test_corrupt_png_checksum() -> None:
    data = bytearray(noise("PNG"))
    data[200] ^= 0xFF  # inside IDAT: the CRC no longer matches
    with pytest.raises(MediaError, match="cannot be decoded"):
        decode_image(bytes(data), F)


def test_pixel_cap_is_checked_before_decoding() -> None:
    bomb = image_bytes("PNG", (4000, 4000), mode="L")  # 16 MP of zeros: a few KB
    assert len(bomb) < 100_000
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="--max-image-pixels"):
        decode_image(bomb, F, max_pixels=1_000_000)
    assert time.monotonic() - t0 < 1.0
    huge = bytearray(image_bytes("PNG", (1, 1)))
    huge[16:24] = (100_000).to_bytes(4, "big") * 2  # IHDR claims 10^10 pixels
    huge[29:33] = zlib.crc32(bytes(huge[12:29])).to_bytes(4, "big")
    with pytest.raises(MediaError, match="pixels"):
        decode_image(bytes(huge), F)


# ---------------------------------------------------------------------------- data URLs


def test_data_url(loader: MediaLoader) -> None:
    assert load(loader, data_url(image_bytes())).size == (8, 6)
    assert load(loader, data_url(image_bytes("JPEG"), "image/jpeg")).mode == "RGB"


@pytest.mark.parametrize("url,words", [
    ("data:image/png,abc", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,!!!notbase64", "not valid base64"),
    ("data:image/png;base64,", "no data"),
    ("data:nocomma", "data:image/png;base64"),
    ("ftp://example.com/x.png", "data:, http(s):// or file://"),
    ("just text", "data:, http(s):// or file://"),
])
def test_bad_data_urls(loader: MediaLoader, url: str, words: str) -> None:
    err = refused(loader, url, words)
    assert "!!!" not in str(err)  # the URL's data never appears in the message


def test_data_url_over_byte_cap_refused_before_decoding() -> None:
    big = "A" * (4 * 1024 * 1024)
    with pytest.raises(MediaError, match="--max-image-bytes"):
        parse_data_url("data:image/png;base64," + big, F, 1 << 20)


def test_non_string_url(loader: MediaLoader) -> None:
    with pytest.raises(MediaError, match="non-empty string"):
        asyncio.run(loader.load_image(None, F))


# ---------------------------------------------------------------------------- http(s)


def test_http_fetch_bounds(loader: MediaLoader) -> None:
    with media_server(image_bytes()) as base:
        assert load(loader, f"{base}/img.png").size == (8, 6)
        assert load(loader, f"{base}/redirect/2").size == (8, 6)
        refused(loader, f"{base}/redirect/9", "redirected more than")
        refused(loader, f"{base}/404", "HTTP 404")
        t0 = time.monotonic()
        refused(loader, f"{base}/sleep", "--media-fetch-timeout")
        assert time.monotonic() - t0 < 5.0
        t0 = time.monotonic()
        refused(loader, f"{base}/big", "--max-image-bytes")  # cut off after ~1 MiB
        refused(loader, f"{base}/big-declared", "--max-image-bytes")
        assert time.monotonic() - t0 < 5.0
    refused(loader, f"{base}/img.png", "failed")  # nothing listens any more


def test_allowed_media_domains() -> None:
    ld = MediaLoader(MediaConfig(allowed_media_domains=("example.com",)))
    try:
        with media_server(image_bytes()) as base:
            refused(ld, f"{base}/img.png", "--allowed-media-domains")
    finally:
        ld.close()


# ---------------------------------------------------------------------------- file://


def test_file_urls(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(image_bytes())
    secret = tmp_path / "secret.png"
    secret.write_bytes(image_bytes())
    (allowed / "escape.png").symlink_to(secret)
    (allowed / "inside.png").symlink_to(allowed / "ok.png")
    os.mkfifo(allowed / "fifo.png")
    (allowed / "big.png").write_bytes(b"\0" * (2 << 20))

    closed = MediaLoader(MediaConfig(max_image_bytes=1 << 20))
    ld = MediaLoader(MediaConfig(allowed_local_media_path=str(allowed),
                                 max_image_bytes=1 << 20))
    try:
        refused(closed, f"file://{allowed}/ok.png", "--allowed-local-media-path")
        assert load(ld, f"file://{allowed}/ok.png").size == (8, 6)
        assert load(ld, f"file://{allowed}/inside.png").size == (8, 6)
        refused(ld, f"file://{secret}", "outside the directory")
        refused(ld, f"file://{allowed}/../secret.png", "outside the directory")
        refused(ld, f"file://{allowed}/escape.png", "outside the directory")
        refused(ld, f"file://{allowed}/fifo.png", "not a regular file")
        refused(ld, f"file://{allowed}/big.png", "--max-image-bytes")
        refused(ld, f"file://{allowed}/missing.png", "cannot be read")
        refused(ld, f"file://{allowed}", "not a regular file")
        refused(ld, f"file://otherhost{allowed}/ok.png", "local path")
    finally:
        ld.close()
        closed.close()


def test_config_checks_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--media-fetch-timeout"):
        MediaConfig(fetch_timeout=0)
    with pytest.raises(ValueError, match="--max-image-pixels"):
        MediaConfig(max_image_pixels=0)


def test_request_pixel_budget() -> None:
    cfg = MediaConfig(max_image_pixels=1000, max_request_pixels=2500)
    ld = MediaLoader(cfg)
    try:
        budget = ld.request_budget()
        url = data_url(image_bytes("PNG", (30, 30)))  # 900 pixels each
        for _ in range(2):
            asyncio.run(ld.load_image(url, F, budget))
        with pytest.raises(MediaError, match="--max-image-pixels-per-request") as ei:
            asyncio.run(ld.load_image(url, F, budget))
        assert ei.value.param == F and budget.used == 1800
        asyncio.run(ld.load_image(url, F, ld.request_budget()))  # a new request: fresh
    finally:
        ld.close()
