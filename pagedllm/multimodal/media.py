"""Images a client names by URL: ``data:`` (base64), ``http(s)://`` and ``file://``,
loaded into RGB ``PIL.Image``\\ s under bounds, for the server's chat endpoints.

Contract:

* ``MediaLoader.load_image(url, param)`` returns an RGB image or raises ``MediaError``
  (a ``ValueError``) whose ``param`` is the request field that held the URL (e.g.
  ``messages.0.content.1.image_url.url``) and whose message says what was wrong without
  quoting the bytes (image bytes and data URLs never reach a message or a log line).
* Bounds (``MediaConfig``; the server's flags, docs/server.md "Images"):

  - ``http(s)``: the whole fetch (connect, redirects, body) within ``fetch_timeout``
    seconds; the body streamed and cut off once it passes ``max_image_bytes`` (a
    ``Content-Length`` over the cap is refused before reading any of it); at most
    ``max_redirects`` redirects, each to ``http(s)`` only and, with
    ``allowed_media_domains``, only to those hosts.
  - ``data:``: base64 only, media type ``image/*``; the decoded size under
    ``max_image_bytes`` (checked from the text's length before decoding).
  - ``file://``: only with ``allowed_local_media_path``; the path with symlinks and
    ``..`` resolved must lie inside it; only a regular file of at most
    ``max_image_bytes`` (a FIFO or device never blocks the reader).
  - decoding (Pillow): only PNG, JPEG (and MPO), WebP, GIF (first frame) and BMP;
    width x height at most ``max_image_pixels`` (checked from the header, before any
    pixel is decoded: a decompression bomb costs nothing); truncated or corrupt data
    refused; the result converted to RGB (transparency composited over white, as vLLM).
  - per request (``PixelBudget``): all its images together at most
    ``max_request_pixels``, also checked from each header before decoding (a 16 MiB
    body of small PNG bombs just under the per-image cap would decode to tens of GB).

* Nothing blocks the event loop: fetching is ``aiohttp`` (a dependency already),
  reading files and decoding run on the loader's own small thread pool.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import re
import struct  # some Pillow decoders raise struct.error on short headers
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from pagedllm.model_files.safe_open import UnsafeFileError, read_regular

# Pillow's openers we decode with (anything else, TIFF, SVG, ICO, PSD ..., is refused);
# JPEG's also opens a phone's multi-picture (MPO) JPEG, of which the first is used.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's per-image limit
DEFAULT_MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # 33.5 MP: 96 MiB as RGB
DEFAULT_MAX_REQUEST_PIXELS = 64 * 1024 * 1024  # all of one request's images: 192 MiB
DEFAULT_MAX_REDIRECTS = 3
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.ASCII)
_CHUNK = 64 * 1024


class MediaError(ValueError):
    """An image a request names cannot be used; ``param`` is the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaConfig:
    """Bounds on loading images (flags of ``pagedllm serve``, vLLM's names where vLLM
    has one).  ``ValueError`` naming the flag on a bad value or directory."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    def __post_init__(self) -> None:
        if not self.fetch_timeout > 0:
            raise ValueError(f"--media-fetch-timeout must be > 0, got {self.fetch_timeout}")
        if self.max_image_bytes < 1:
            raise ValueError(f"--max-image-bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_request_pixels < 1:
            raise ValueError(f"--max-image-pixels-per-request must be >= 1, got "
                             f"{self.max_request_pixels}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        path = self.allowed_local_media_path
        if path:
            real = os.path.realpath(path)
            if not os.path.isdir(real):
                raise ValueError(f"--allowed-local-media-path: {path} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", real)
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains", tuple(
                d.lower().rstrip(".") for d in self.allowed_media_domains))


class PixelBudget:
    """The pixels one request's images may decode to in all (thread-safe: the decode
    threads draw on it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, pixels: int, param: str) -> None:
        """Reserve ``pixels``; ``MediaError`` naming ``param`` past the limit."""
        with self._lock:
            if self.used + pixels > self.limit:
                raise MediaError(f"the request's images hold more than the {self.limit} "
                                 "pixels allowed in all (--max-image-pixels-per-request)",
                                 param)
            self.used += pixels


def decode_image(data: bytes, param: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 budget: PixelBudget | None = None) -> Image.Image:
    """``data`` decoded into an RGB image (the first frame of an animation);
    ``MediaError`` naming ``param`` for an unsupported format, a size over
    ``max_pixels`` (or over what is left of ``budget``) or data Pillow cannot decode
    in full.  Synchronous, CPU-bound."""
    try:
        with warnings.catch_warnings():
            # Our own pixel cap applies; Pillow's process-wide one only warns below 2x.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
            w, h = img.size
            if w * h > max_pixels:
                raise MediaError(f"the image is {w}x{h} = {w * h} pixels, more than the "
                                 f"{max_pixels} allowed (--max-image-pixels)", param)
            if w < 1 or h < 1:
                raise MediaError(f"the image has no pixels ({w}x{h})", param)
            if budget is not None:
                budget.take(w * h, param)
            img.verify()  # checksums and structure, where the format has them
            img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
            img.seek(0)
            img.load()  # truncated data raises here (LOAD_TRUNCATED_IMAGES is off)
            return _to_rgb(img)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError("not an image in a supported format (PNG, JPEG, WebP, GIF or "
                         "BMP), or its header is corrupt", param) from None
    except Image.DecompressionBombError:
        raise MediaError(f"the image has more than the {max_pixels} pixels allowed "
                         "(--max-image-pixels)", param) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError,
            struct.error, MemoryError) as e:
        kind = "truncated" if "truncated" in str(e) else "corrupt"
        raise MediaError(f"the image data is {kind} and cannot be decoded", param) from None


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB; an alpha channel (or palette transparency) composited over white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def parse_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL (``MediaError`` naming ``param``)."""
    m = _DATA_URL.match(url)
    if m is None:
        raise MediaError("a data URL must look like data:image/png;base64,...", param)
    mime = m.group("type").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if mime and not mime.startswith("image/"):
        raise MediaError(f"a data URL of media type {mime[:40]!r} is not an image", param)
    if "base64" not in params:
        raise MediaError("a data URL must be base64-encoded (data:image/...;base64,...)",
                         param)
    text = url[m.end():]
    if len(text) // 4 * 3 > max_bytes + 3:  # the decoded size, before decoding it
        raise MediaError(f"the image is larger than the {max_bytes} bytes allowed "
                         "(--max-image-bytes)", param)
    if any(c in text for c in " \t\r\n"):
        text = re.sub(r"[ \t\r\n]", "", text)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL is not valid base64", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"the image is larger than the {max_bytes} bytes allowed "
                         "(--max-image-bytes)", param)
    if not data:
        raise MediaError("the data URL holds no data", param)
    return data


class MediaLoader:
    """Loads images under a ``MediaConfig`` (one per server; no global state).
    ``close()`` stops its thread pool."""

    def __init__(self, config: MediaConfig | None = None, max_workers: int = 2) -> None:
        self.config = config or MediaConfig()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedllm-media")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def request_budget(self) -> PixelBudget:
        """A fresh ``PixelBudget`` for one request's images."""
        return PixelBudget(self.config.max_request_pixels)

    async def load_image(self, url: object, param: str,
                         budget: PixelBudget | None = None) -> Image.Image:
        """The RGB image ``url`` names (``MediaError`` naming ``param``), drawing its
        pixels from ``budget`` (one per request) when given."""
        data = await self.load_bytes(url, param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, decode_image, data, param,
                                          self.config.max_image_pixels, budget)

    async def load_bytes(self, url: object, param: str) -> bytes:
        """The raw bytes ``url`` names, within the byte cap (not yet decoded)."""
        if not isinstance(url, str) or not url:
            raise MediaError("must be a non-empty string (a data:, http(s):// or file:// "
                             "URL)", param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        cap = self.config.max_image_bytes
        if scheme == "data":
            return parse_data_url(url, param, cap)
        if scheme in ("http", "https"):
            return await self._fetch(url, param)
        if scheme == "file":
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.read_file, url, param)
        raise MediaError("the image URL must be a data:, http(s):// or file:// URL", param)

    # ------------------------------------------------------------------ file://

    def read_file(self, url: str, param: str) -> bytes:
        """A ``file://`` URL's bytes, only from under ``allowed_local_media_path``."""
        root = self.config.allowed_local_media_path
        if not root:
            raise MediaError("file:// URLs are not allowed on this server (start it with "
                             "--allowed-local-media-path DIR)", param)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("a file:// URL must name a local path (file:///path)", param)
        path = unquote(parts.path)
        if "\x00" in path:
            raise MediaError("the file:// path is not valid", param)
        real = os.path.realpath(path)  # symlinks and .. resolved
        if os.path.commonpath([real, root]) != root:
            raise MediaError("the file is outside the directory allowed by "
                             "--allowed-local-media-path", param)
        cap = self.config.max_image_bytes
        try:
            return read_regular(real, cap, encoding=None)  # type: ignore[no-any-return]
        except UnsafeFileError as e:
            msg = ("the path is not a regular file" if "regular" in str(e) else
                   f"the file is larger than the {cap} bytes allowed (--max-image-bytes)")
            raise MediaError(msg, param) from None
        except OSError:
            raise MediaError("the file cannot be read (it does not exist or is not "
                             "readable)", param) from None

    # ------------------------------------------------------------------ http(s)://

    def _check_host(self, url: str, param: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise MediaError("the image URL (or a redirect) is not an http(s) URL with a "
                             "host", param)
        allowed = self.config.allowed_media_domains
        if allowed is not None and parts.hostname.lower().rstrip(".") not in allowed:
            raise MediaError("the image URL's host is not in --allowed-media-domains", param)

    async def _fetch(self, url: str, param: str) -> bytes:
        import aiohttp

        timeout = self.config.fetch_timeout
        try:  # the whole fetch, redirects and body included, within the timeout
            return await asyncio.wait_for(self._get(url, param), timeout)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            raise MediaError(f"fetching the image URL took longer than {timeout:g} s "
                             "(--media-fetch-timeout)", param) from None
        except aiohttp.ClientError as e:
            raise MediaError(f"fetching the image URL failed ({type(e).__name__})",
                             param) from None

    async def _get(self, url: str, param: str) -> bytes:
        import aiohttp

        cfg = self.config
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=cfg.fetch_timeout),
                trust_env=False) as session:
            for _ in range(cfg.max_redirects + 1):
                self._check_host(url, param)
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) \
                            and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    if resp.status != 200:
                        raise MediaError(f"fetching the image URL answered HTTP "
                                         f"{resp.status}", param)
                    return await self._read_body(resp, param)
        raise MediaError(f"the image URL redirected more than {cfg.max_redirects} times",
                         param)

    async def _read_body(self, resp: object, param: str) -> bytes:
        cap = self.config.max_image_bytes
        too_big = MediaError(f"the image at the URL is larger than the {cap} bytes "
                             "allowed (--max-image-bytes)", param)
        length = resp.content_length  # type: ignore[attr-defined]
        if length is not None and length > cap:
            raise too_big
        buf = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK):  # type: ignore[attr-defined]
            buf += chunk
            if len(buf) > cap:
                raise too_big  # the connection closes with the session: no more is read
        if not buf:
            raise MediaError("the image URL answered with an empty body", param)
        return bytes(buf)
