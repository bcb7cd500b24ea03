"""The fixed per-request path under uvicorn's httptools protocol: an answer of known length goes
out in one write to the client's socket (`gateway.api.asgi.send_whole`), and a body that has
arrived whole is read without arming a deadline (`body_arrived`). Real uvicorn servers and
sockets on loopback; the client's transport is the server's own, counted as it writes."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.asgi import StatusSend, body_arrived
from gateway.api.responses import JSONBytes
from tests.servers import CountedWrites, Served, start_app, wait_until

pytestmark = pytest.mark.e2e


async def _lifespan(receive: Receive, send: Send) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


def counting_app(seen: list[CountedWrites], statuses: list[int | None] | None = None) -> Any:
    """Answers every request with a JSON body through the gateway's `StatusSend` (the status it
    noted appended to `statuses`: what the app counts the request by)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        cycle = send.__self__  # type: ignore[attr-defined]
        counted = CountedWrites(cycle.transport)
        cycle.transport = counted
        seen.append(counted)
        response = JSONBytes(b'{"ok":true}', {"x-kvgate-replica": "r1"})
        tracked = StatusSend(send)
        await response(scope, receive, tracked)
        if statuses is not None:
            statuses.append(tracked.status)

    return app


def test_an_answer_of_known_length_goes_out_in_one_write_on_a_kept_connection() -> None:
    seen: list[CountedWrites] = []
    statuses: list[int | None] = []
    served = start_app(counting_app(seen, statuses))
    try:
        with httpx.Client() as http:
            for _ in range(3):  # the same connection serves the next request
                r = http.get(served.url + "/")
                assert r.status_code == 200 and r.json() == {"ok": True}
                assert r.headers["content-length"] == "11"
                assert r.headers["content-type"] == "application/json"
                assert r.headers["x-kvgate-replica"] == "r1"
        assert len(seen) == 3
        assert statuses == [200, 200, 200]
        for counted in seen:
            assert len(counted.writes) == 1, counted.writes
            head, _, body = counted.writes[0].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b'{"ok":true}'
    finally:
        served.stop()


def test_a_connection_the_client_closes_gets_the_whole_answer_then_the_close() -> None:
    seen: list[CountedWrites] = []
    served = start_app(counting_app(seen))
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            received = b""
            while data := sock.recv(65536):  # to the server's close (EOF)
                received += data
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
        assert received.endswith(b'\r\n\r\n{"ok":true}')
        assert b"connection: close" in received.lower()
        (counted,) = seen
        assert len(counted.writes) == 1
        wait_until(lambda: not served.server.server_state.connections, 5, "the server's close")
    finally:
        served.stop()


def test_body_arrived_only_once_uvicorn_holds_the_whole_body() -> None:
    arrived: list[bool] = []
    bodies: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        arrived.append(body_arrived(receive))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    served: Served = start_app(app)
    try:
        head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            sock.sendall(head + b"0123456789")  # whole, with its head
            assert sock.recv(65536).startswith(b"HTTP/1.1 204")
            sock.sendall(head + b"01234")  # half: the app starts before the rest arrives
            wait_until(lambda: len(arrived) == 2, 5, "the second request's start")
            sock.sendall(b"56789")
            assert sock.recv(65536).startswith(b"HTTP/1.1 204")
        assert arrived == [True, False]
        assert bodies == [b"0123456789", b"0123456789"]
    finally:
        served.stop()


def test_json_bytes_sends_the_head_starlettes_response_would() -> None:
    body = b'{"id":"x"}'
    for headers in ({}, {"X-Kvgate-Replica": "http://r1", "x-kvgate-decision": "prefix"}):
        ours = JSONBytes(body, headers, status_code=201)
        theirs = Response(body, 201, headers, media_type="application/json")
        assert ours.raw_headers == theirs.raw_headers
        assert (ours.status_code, ours.body) == (theirs.status_code, theirs.body)
        assert ours.headers["content-length"] == "10"
