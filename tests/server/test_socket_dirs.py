"""A SIGKILLed API server leaves its ipc socket directory behind; the next start removes
it (and nothing that is not provably stale)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from pagedllm.engine import socket_dirs
from tests.server.harness import running_server, wait_until


def test_sigkilled_server_socket_dir_removed_at_next_start() -> None:
    with running_server() as s:
        m = re.search(r"engine transport: input ipc://(\S+)/input", s.log())
        assert m, s.log()
        left = m.group(1)
        assert os.path.basename(left).startswith(f"{socket_dirs.PREFIX}{s.pid}-")
        os.kill(s.pid, signal.SIGKILL)  # no shutdown code runs
        s.proc.wait(10)
        assert wait_until(lambda: not s.descendants(), timeout=15)
        assert os.path.isdir(left)
    # What every server start does before making its own directory.
    mine = socket_dirs.make_socket_dir()
    try:
        assert not os.path.exists(left)
        assert os.path.isdir(mine)
    finally:
        shutil.rmtree(mine)


def test_only_stale_socket_dirs_are_removed() -> None:
    tmp = tempfile.mkdtemp()
    try:
        # A directory with a real socket file, owned by a process that has exited.
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        stale = os.path.join(tmp, f"{socket_dirs.PREFIX}{dead.pid}-abc")
        os.mkdir(stale)
        with socket.socket(socket.AF_UNIX) as sock:  # closing leaves the file, as a kill
            sock.bind(os.path.join(stale, "input"))
        assert os.listdir(stale) == ["input"]
        # A live owner (this process), and a dead owner's directory holding a file that
        # is not a socket: both kept.
        live = os.path.join(tmp, f"{socket_dirs.PREFIX}{os.getpid()}-abc")
        odd = os.path.join(tmp, f"{socket_dirs.PREFIX}{dead.pid}-odd")
        for d in (live, odd):
            os.mkdir(d)
        with open(os.path.join(odd, "notes.txt"), "w") as f:
            f.write("not a socket")
        os.mkdir(os.path.join(tmp, "pagedllm-other"))
        removed = socket_dirs.remove_stale_socket_dirs(tmp)
        assert removed == [stale]
        assert sorted(os.listdir(tmp)) == sorted(
            os.path.basename(p) for p in (live, odd, "pagedllm-other"))
    finally:
        shutil.rmtree(tmp)
