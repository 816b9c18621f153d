"""The private directories holding the ipc sockets of the engine transport.

Each API server makes one (``make_socket_dir``), mode 0700, named
``pagedllm-engine-<pid>-<random>`` after the process that owns it, and removes it at
shutdown.  A SIGKILLed server cannot, so every start first removes the directories of
servers that are gone: owned by this user, named with a pid that no longer exists, and
holding nothing but socket files (so nothing else that happens to match is touched).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

PREFIX = "pagedllm-engine-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[^/]+\Z")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _is_stale(path: str, pid: int) -> bool:
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        entries = list(os.scandir(path))
    except OSError:
        return False
    if _pid_alive(pid):
        return False
    return all(stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode) for e in entries)


def remove_stale_socket_dirs(tmp: str | None = None) -> list[str]:
    """Remove the socket directories left by dead servers under ``tmp`` (default: the
    system temp dir); returns the paths removed."""
    tmp = tmp or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        path = os.path.join(tmp, name)
        if _is_stale(path, int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d stale engine socket director%s left by killed servers",
                    len(removed), "y" if len(removed) == 1 else "ies")
    return removed


def make_socket_dir() -> str:
    """Clean up after dead servers, then make this process' private socket directory."""
    remove_stale_socket_dirs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
