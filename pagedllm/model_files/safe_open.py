"""Open a file a client or a flag names, without letting it block or flood the reader.

``open()`` on a FIFO waits for a writer (forever, on the API server's one tokenizer
thread, while ``/health`` says 200); a character device (``/dev/zero``) never ends; a
directory fails late with a confusing message.  ``open_regular`` opens with
``O_NONBLOCK`` (a FIFO opens at once) and then checks the *opened* file with ``fstat``
(no window between a check and the open): anything but a regular file, or one larger
than ``max_bytes``, is an ``UnsafeFileError`` (an ``OSError``, so callers that already
report unreadable files report these too).  ``O_NONBLOCK`` has no effect on the reads of
a regular file.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any


class UnsafeFileError(OSError):
    """Not a regular file, or larger than the caller allows."""


def open_regular(path: str | os.PathLike[str], mode: str = "r", *,
                 max_bytes: int | None = None, **kwargs: Any) -> IO[Any]:
    """``open(path, mode, **kwargs)`` for reading, refusing a non-regular file or one
    over ``max_bytes``.  ``mode`` is ``"r"`` or ``"rb"``."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only (mode 'r' or 'rb'), not {mode!r}")
    name = os.path.basename(os.fspath(path)) or os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{name} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFileError(f"{name} is {st.st_size} bytes, more than the "
                                  f"{max_bytes} allowed")
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], max_bytes: int,
                 encoding: str | None = "utf-8") -> Any:
    """The whole of a regular file of at most ``max_bytes`` (``str``, or ``bytes``
    when ``encoding`` is None); ``UnsafeFileError`` otherwise."""
    mode = "rb" if encoding is None else "r"
    kw = {} if encoding is None else {"encoding": encoding}
    with open_regular(path, mode, max_bytes=max_bytes, **kw) as f:
        # Read one byte past the cap: a file that grew after fstat is refused too.
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # characters <= bytes, so this is exact for bytes only
        raise UnsafeFileError(f"{os.path.basename(os.fspath(path))} is larger than the "
                              f"{max_bytes} bytes allowed")
    return data
