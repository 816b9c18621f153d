"""``free_port`` hands out ports that no socket the kernel numbers itself can take in the
moment before the rendezvous binds them (the cause of a CI failure: an earlier gloo
world's pair connection was given the data-parallel lockstep's port, ``EADDRINUSE``)."""

from __future__ import annotations

import socket

from pagedllm.executor import process_start
from pagedllm.executor.process_start import _ephemeral_low, free_port


def test_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    lo = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    if lo - process_start._PORT_FLOOR >= 1000:
        assert all(process_start._PORT_FLOOR <= p < lo for p in ports)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped(monkeypatch) -> None:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    try:
        # Every candidate below the range is the taken port; free_port falls back to the
        # kernel's choice instead of returning it.
        monkeypatch.setattr(process_start.random, "Random",
                            lambda: type("R", (), {"randrange": lambda self, a, b: taken})())
        port = free_port()
        assert port != taken
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    finally:
        held.close()
