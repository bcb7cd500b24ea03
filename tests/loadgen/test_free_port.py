"""The ports the harness gives the servers it starts as subprocesses (`processes.free_port`)."""

from __future__ import annotations

import socket

from loadgen.harness import processes


def test_a_port_is_below_the_ephemeral_range_held_by_nothing_and_handed_out_once() -> None:
    """A port the kernel chose (`bind(0)`) is one outgoing connections' source ports are drawn
    from: a connection took one between its choice and a gateway's bind, and the gateway
    exited at start (CI, three workers). The ports handed out are below that range, distinct,
    and not one a socket holds."""
    low = processes._ephemeral_low()
    block = processes._port_block()
    ports = [processes.free_port()]  # the cursor set: the next port looked at is known
    with socket.socket() as held:
        held.bind(("127.0.0.1", block[(processes._cursor[0] + 1) % len(block)]))
        held.listen()
        ports += [processes.free_port() for _ in range(50)]
        assert held.getsockname()[1] not in ports
    assert all(processes.LOWEST_PORT <= port < low for port in ports), ports
    assert len(set(ports)) == len(ports)
    assert all(port in block for port in ports)
