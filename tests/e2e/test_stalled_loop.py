"""A gateway whose event loop stalls (CPU starvation; here SIGSTOP, deterministically) loses no
request that reached its socket. A `kvgate serve` process over loopback; the client is a raw
socket, so which side closes the connection is plain.

The suspect this rules out: a request written on a kept-alive connection while the loop is
stalled, whose keep-alive timer ran out during the stall. Were the expired timer run before the
socket is read, uvicorn would close the connection with the request unread in it. It is not:
the loop (uvloop) reads the request first. What did lose requests is the other order, the
client lagging behind the server's close (tests/gateway/test_serve_config.py;
docs/reliability.md, "Nothing lost under CPU starvation")."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from loadgen.harness import processes
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e

KEEP_ALIVE_S = 0.2
"""The gateway's keep-alive in this test: short, so the stall outlives it quickly."""


def _request() -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"content-type: application/json\r\nauthorization: Bearer %s\r\n"
        b"content-length: %d\r\n\r\n%s" % (TENANT_KEY.encode(), len(body), body)
    )


def _response(conn: socket.socket) -> tuple[int, bytes]:
    """One whole response (status, body) off the connection; (0, b"") if it was closed
    first."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            return 0, b""
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "the gateway closed mid-body"
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def _unread_bytes(server_port: int, client_port: int) -> int:
    """The bytes waiting unread in the server side's socket of one loopback connection
    (/proc/net/tcp's rx_queue), so the test knows the request has arrived, without a sleep."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == server_port and (
            int(remote.split(":")[1], 16) == client_port
        ):
            return int(fields[4].split(":")[1], 16)
    return 0


@pytest.fixture
def gateway_process(
    start_engines: Callable[..., list[Served]],
) -> Iterator[processes.Proc]:
    (engine,) = start_engines(1)
    proc = processes.start_gateway(
        processes.free_port(),
        [engine.url],
        ["--tenant", f"acme:{TENANT_KEY}"],
        env={"KVGATE_CLIENT_KEEP_ALIVE_S": str(KEEP_ALIVE_S), "KVGATE_SERVER_SECRET": "t"},
    )
    try:
        processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
        yield proc
    finally:
        processes.stop([proc])


def test_a_request_sent_while_the_loop_is_stalled_past_its_keep_alive_is_answered(
    gateway_process: processes.Proc,
) -> None:
    port = int(gateway_process.url.rsplit(":", 1)[1])
    with contextlib.closing(socket.create_connection(("127.0.0.1", port))) as conn:
        conn.settimeout(30)
        conn.sendall(_request())
        assert _response(conn)[0] == 200
        answered = time.monotonic()
        os.kill(gateway_process.pid, signal.SIGSTOP)  # the loop stalls, its timer armed
        try:
            conn.sendall(_request())  # on the kept-alive connection, still open
            client_port = conn.getsockname()[1]
            wait_until(lambda: _unread_bytes(port, client_port) > 0, 10, "the request queued")
            # the stall outlives the keep-alive: its timer is due when the loop runs again
            wait_until(lambda: time.monotonic() - answered > 2 * KEEP_ALIVE_S, 10, "expiry")
        finally:
            os.kill(gateway_process.pid, signal.SIGCONT)
        status, body = _response(conn)
        assert status == 200, "the gateway closed a connection that held a request"
        assert orjson.loads(body)["choices"]
        # the keep-alive was in force: idle now, the connection is the gateway's to close
        assert conn.recv(1) == b""
