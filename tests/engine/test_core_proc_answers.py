"""The engine core never drops a request without answering it (issue 46 item 3).

Real msgspec frames through the real sockets of ``EngineCoreProc``: a request the core
cannot accept -- a field of the wrong type (the typed decode fails, and with it the whole
batch), or an ``add_request`` that raises -- still gets a finished output (``ABORT``),
and the well-formed requests of the same batch are added.  Only a message with no
readable request id is dropped (and counted)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from pagedllm.engine.core_proc import KIND_ADD, KIND_OUTPUTS, EngineCoreProc
from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams


class _Core:
    """Accepts every request except those whose id starts with ``refuse``."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id.startswith("refuse"):
            raise RuntimeError("cannot take this one")
        self.added.append(req.request_id)


def _request(rid: str, **so_fields: Any) -> dict[str, Any]:
    so = StructuredOutputsParams(json_object=True)
    req = EngineCoreRequest(rid, [1, 2, 3],
                            SamplingParams(max_tokens=4, structured_outputs=so),
                            arrival_time=time.time(), fork_ids=[rid + "-1"])
    d = msgspec.to_builtins(req)
    d["sampling_params"]["structured_outputs"].update(so_fields)
    return d


def test_a_request_the_engine_cannot_accept_is_answered() -> None:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core = _Core()
    proc = None
    try:
        port_in = push.bind_to_random_port("tcp://127.0.0.1")
        port_out = pull.bind_to_random_port("tcp://127.0.0.1")
        proc = EngineCoreProc(core, f"tcp://127.0.0.1:{port_in}",
                              f"tcp://127.0.0.1:{port_out}", parent_pid=0)
        enc = msgspec.msgpack.Encoder()
        batches = [
            [_request("ok-1"), _request("bad-1", disable_any_whitespace="yes"),
             _request("bad-2", json_object=1), {"request_id": 7}],  # no id: dropped
            [_request("bad-3", disable_any_whitespace=None)],
            [_request("bad-4", disable_any_whitespace={})],
            [_request("refuse-1"), _request("ok-2")],
        ]
        for batch in batches:
            push.send_multipart([KIND_ADD, enc.encode(batch)])
        answered: dict[str, FinishReason | None] = {}
        want = {f"{r}{s}" for r in ("bad-1", "bad-2", "bad-3", "bad-4", "refuse-1")
                for s in ("", "-1")}
        deadline = time.monotonic() + 20
        while not want <= answered.keys() and time.monotonic() < deadline:
            proc.drain_inputs(100)
            while pull.poll(0):
                kind, payload = pull.recv_multipart()
                assert kind == KIND_OUTPUTS
                outs = msgspec.msgpack.decode(payload, type=EngineCoreOutputs)
                answered.update((o.request_id, o.finish_reason) for o in outs.outputs)
        assert want <= answered.keys(), answered
        assert all(answered[r] == FinishReason.ABORT for r in want)
        assert core.added == ["ok-1", "ok-2"]
        # Five malformed requests (counted), one of them without a readable id.
        assert proc.num_malformed == 5
    finally:
        if proc is not None:
            proc.close()
        ctx.destroy(linger=0)
