"""The gateway's HTTP protocol keeps uvicorn's keep-alive deadline with one timer an idle spell
(gateway.server.keepalive): a connection closes `timeout_keep_alive` after its last response,
not after the response that armed the timer, and never under a request in flight."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from gateway.server.keepalive import LazyKeepAlive
from tests.servers import Served, serve_lifespan, start_app

KEEP_ALIVE_S = 0.3
SLOW_S = 0.5
"""How long `/slow` takes: past the keep-alive timer armed by the response before it."""


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)  # the scenario: a request still in flight at the timer
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server() -> Iterator[Served]:
    served = start_app(app, http=LazyKeepAlive, timeout_keep_alive=cast(int, KEEP_ALIVE_S))
    try:
        yield served
    finally:
        served.stop()


def _get(sock: socket.socket, path: str) -> None:
    sock.sendall(b"GET %s HTTP/1.1\r\nhost: test\r\n\r\n" % path.encode())
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        data = sock.recv(4096)
        assert data, f"closed before the answer to {path}: {got!r}"
        got += data
    assert got.startswith(b"HTTP/1.1 200")


def _seconds_to_close(sock: socket.socket) -> float:
    started = time.monotonic()
    assert sock.recv(4096) == b""
    return time.monotonic() - started


def test_a_connection_idle_again_waits_its_whole_keep_alive(server: Served) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        _get(sock, "/")  # arms the timer
        time.sleep(KEEP_ALIVE_S * 2 / 3)  # the scenario: the next request before it fires
        _get(sock, "/")
        assert _seconds_to_close(sock) >= KEEP_ALIVE_S * 0.8


def test_a_request_in_flight_when_the_timer_fires_is_answered(server: Served) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        _get(sock, "/")  # arms the timer; it fires while /slow is in flight
        _get(sock, "/slow")
        assert _seconds_to_close(sock) >= KEEP_ALIVE_S * 0.8
