"""``pagedllm bench serve`` against a real server, and the socket options that keep
streamed chunks from waiting on delayed ACKs."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import httpx
import matplotlib.image

from pagedllm.entrypoints.openai.api_server import _bind
from tests.server.harness import ServerProcess


def test_bench_serve_reports_every_request(server: ServerProcess, tmp_path) -> None:
    out = tmp_path / "w2.json"
    cmd = [sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", server.url,
           "--num-prompts", "6", "--request-rate", "50",
           "--input-len-range", "8", "24", "--output-len-range", "4", "8",
           "--output-json", str(out), "--save-detailed", "--plot", str(tmp_path / "w2.png")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout and "Client CPU" in done.stdout
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (6, 0)
    # No --vocab-hi: the ids stay below the served tokenizer's vocabulary (SmolLM2: 49152).
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert s["args"]["vocab_hi"] == min(128000, info["vocab_size"]) == 49152
    # min_tokens = max_tokens with ignore_eos: exactly the drawn lengths come back.
    assert all(4 <= n <= 8 for n in s["output_lens"]) and len(s["output_lens"]) == 6
    assert s["total_output_tokens"] == sum(s["output_lens"])
    assert all(t > 0 for t in s["ttfts"])
    assert s["start_times"] == sorted(s["start_times"])  # open loop: sent in order
    assert all(len(itl) == n - 1 for itl, n in zip(s["itls"], s["output_lens"]))
    assert 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] < s["e2e_s"]["p99"]
    image = matplotlib.image.imread(tmp_path / "w2.png")  # a real PNG, drawn
    assert image.shape[0] > 300 and image.shape[1] > 1000 and image.std() > 0


def test_bench_serve_unreachable_server_is_one_line_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url",
         f"http://127.0.0.1:{port}", "--num-prompts", "2"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and done.stderr.startswith("error:"), done.stderr


def test_accepted_connections_have_nagle_off() -> None:
    """Streamed chunks are small writes: with Nagle's algorithm on, one written while
    the previous is unacknowledged waits for the client's delayed ACK (up to 40 ms)."""
    async def run() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=_bind("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 30)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(run()) != 0


def test_bench_serve_defaults_that_cannot_fit_say_so(server: ServerProcess) -> None:
    """The default lengths (up to 1024 + 512 tokens) against a 256-token server."""
    done = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", server.url,
         "--num-prompts", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("error: input-len-range") and "max_model_len 256" in \
        done.stderr and "Traceback" not in done.stderr, done.stderr
