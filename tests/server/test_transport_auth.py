"""The engine transport refuses local peers that are not the engine core (issue 28):
random bytes, forged msgspec frames and a rogue PULL peer against a real server on
``--engine-transport tcp``; malformed frames from the authenticated peer are dropped and
counted on both ends (real sockets, no server)."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import zmq

from pagedllm.engine.core_proc import KIND_ADD, KIND_OUTPUTS, EngineCoreProc
from pagedllm.engine.mp_client import AsyncMPClient
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from tests.server.harness import ServerProcess, running_server, wait_until


def _ports(s: ServerProcess) -> tuple[int, int]:
    m = re.search(r"engine transport: input tcp://127\.0\.0\.1:(\d+), "
                  r"output tcp://127\.0\.0\.1:(\d+)", s.log())
    assert m, s.log()
    return int(m.group(1)), int(m.group(2))


def _forged_outputs() -> list[list[bytes]]:
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(28)
    return [
        [KIND_OUTPUTS, enc.encode(EngineCoreOutputs(engine_error="forged: die"))],
        [KIND_OUTPUTS, enc.encode(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id="cmpl-x-0", new_token_ids=[1], finish_reason=FinishReason.STOP)]))],
        [KIND_OUTPUTS, rng.randbytes(4096)],
        [b"?", b""],
        [KIND_OUTPUTS],
        [KIND_OUTPUTS, b"", b""],
    ]


def _completion(url: str, i: int) -> int:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": f"Request {i}", "max_tokens": 4, "temperature": 0})
    assert r.json()["choices"][0]["text"] is not None
    return r.status_code


def test_unauthenticated_peers_cannot_inject_or_steal() -> None:
    with running_server("--engine-transport", "tcp") as s:
        port_in, port_out = _ports(s)
        rng = random.Random(0)
        # 1. 4 KiB of random bytes to both ports, on raw TCP connections.
        for port in (port_in, port_out):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(rng.randbytes(4096))
                time.sleep(0.2)
        ctx = zmq.Context()
        try:
            # 2. Forged frames from a NULL-mechanism PUSH and from a CURVE PUSH with its
            #    own keys (it cannot know the server's per-launch key).
            pushers = [ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)]
            pub, sec = zmq.curve_keypair()
            pushers[1].curve_serverkey, _ = zmq.curve_keypair()
            pushers[1].curve_publickey, pushers[1].curve_secretkey = pub, sec
            # 3. Rogue PULL peers on the input port, hoping for a share of the requests.
            pullers = [ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)]
            pullers[1].curve_serverkey, _ = zmq.curve_keypair()
            pullers[1].curve_publickey, pullers[1].curve_secretkey = zmq.curve_keypair()
            for sock in (*pushers, *pullers):
                sock.setsockopt(zmq.LINGER, 0)
            for p in pushers:
                p.connect(f"tcp://127.0.0.1:{port_out}")
            for p in pullers:
                p.connect(f"tcp://127.0.0.1:{port_in}")
            time.sleep(1.0)
            for p in pushers:
                for frames in _forged_outputs():
                    try:
                        p.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:  # no handshaken peer: nothing can be sent
                        pass
            with ThreadPoolExecutor(6) as pool:
                codes = list(pool.map(lambda i: _completion(s.url, i), range(6)))
            assert codes == [200] * 6
            stolen = sum(p.poll(500) for p in pullers)
            assert stolen == 0, "a rogue PULL peer received engine-core input"
        finally:
            ctx.destroy(linger=0)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        assert _completion(s.url, 99) == 200
        # Every refused handshake was logged and counted (raw bytes, the four peers).
        assert wait_until(lambda: s.metrics().get(
            'pagedllm:engine_transport_rejected_total{reason="handshake"}', 0) >= 4,
            timeout=10), s.metrics()
        assert "rejected a peer" in s.log()
        assert s.proc.poll() is None


def test_malformed_frames_from_the_peer_are_dropped_and_counted() -> None:
    """Past authentication (the peer holds the core's keys), a malformed message is
    dropped with a log line and counted by the client, and dropped by the core."""

    async def client_side() -> None:
        client = AsyncMPClient(None, transport="tcp")
        client._bind()
        assert client.keys is not None
        ctx = zmq.Context()
        peer = ctx.socket(zmq.PUSH)
        client.keys.core.secure(peer)
        peer.connect(client.output_addr)
        try:
            forged = _forged_outputs()
            for frames in forged:
                peer.send_multipart(frames)
            got = []
            for _ in forged:
                got.append(client._decode(await asyncio.wait_for(
                    client.output.recv_multipart(), 10)))
            # The two well-formed messages decode; the four others are dropped.
            assert [g is not None for g in got] == [True, True, False, False, False, False]
            assert client.rejected == {"malformed": 4}
        finally:
            peer.close(linger=0)
            ctx.term()
            client.shutdown()

    asyncio.run(client_side())

    # The core's end: garbage on its input socket is dropped, the loop carries on.
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    try:
        port_in = push.bind_to_random_port("tcp://127.0.0.1")
        port_out = pull.bind_to_random_port("tcp://127.0.0.1")
        proc = EngineCoreProc(None, f"tcp://127.0.0.1:{port_in}",
                              f"tcp://127.0.0.1:{port_out}", parent_pid=0)
        for frames in ([KIND_ADD, b"\xff" * 64], [KIND_ADD], [b"?", b""],
                       [KIND_ADD, msgspec.msgpack.encode([{"request_id": 1}])]):
            push.send_multipart(frames)

        def all_dropped() -> bool:
            proc.drain_inputs(100)
            return proc.num_malformed == 4

        assert wait_until(all_dropped, timeout=10)
        proc.close()
    finally:
        ctx.destroy(linger=0)
