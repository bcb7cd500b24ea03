"""The spliced relay (`Exchange.relay`): engine reads written to the client's connection from the
engine connection's own callback. Pinned here: uvicorn's httptools protocol gives us its
transport (else every stream would quietly take the slow path), and a client that stops reading
makes the gateway stop reading the engine, holding a bounded number of bytes, and leaving then
aborts the engine's request. Real uvicorn servers and sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.api.asgi import ChunkedOut, chunked_out, start_chunked
from gateway.pipeline.upstream import MAX_BUFFERED_BYTES
from tests.clients import director
from tests.conftest import MODEL, TENANT_KEY
from tests.servers import CountedWrites, Served, serve_lifespan, start_app, stop_all, wait_until

pytestmark = pytest.mark.e2e

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 16_000 + b'"}}]}\n\n'
HIGH_WATER = 64 * 1024
"""uvicorn's (asyncio's) write-buffer high-water mark on the client's transport."""


def test_uvicorn_gives_the_relay_its_transport_and_the_chunks_frame_right() -> None:
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] in ("http", "lifespan")
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        out = chunked_out(send)
        seen.append(out)
        assert out is not None
        out.write(b"data: 1\n\n")
        out.write(b"data: 2\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    served = start_app(app)
    try:
        with httpx.Client() as http:
            for _ in range(2):  # and the connection is still good for the next request
                r = http.get(served.url + "/")
                assert r.content == b"data: 1\n\ndata: 2\n\n"
                assert r.headers["transfer-encoding"] == "chunked"
    finally:
        served.stop()
    assert len(seen) == 2 and all(isinstance(out, ChunkedOut) for out in seen)


def test_a_streams_start_goes_out_with_its_first_events_in_one_write() -> None:
    """`start_chunked` holds the head for the writer's first chunk (a write less a stream); a
    stream that writes nothing sends its head at `flush`, before its end."""
    writes: list[list[bytes]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        cycle = send.__self__  # type: ignore[attr-defined]
        cycle.transport = counted = CountedWrites(cycle.transport)
        writes.append(counted.writes)
        out = await start_chunked(send, {"type": "http.response.start", "status": 200})
        assert out is not None
        if scope["path"] == "/events":
            out.write(b"data: 1\n\n")
            out.write(b"data: 2\n\n")
        out.flush()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    served = start_app(app)
    try:
        with httpx.Client() as http:
            r = http.get(served.url + "/events")
            assert r.content == b"data: 1\n\ndata: 2\n\n"
            assert r.headers["transfer-encoding"] == "chunked"
            assert http.get(served.url + "/nothing").content == b""  # the same connection
    finally:
        served.stop()
    events, nothing = writes
    assert len(events) == 3 and events[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert events[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert events[1:] == [b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]
    assert len(nothing) == 2 and nothing[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert nothing[1] == b"0\r\n\r\n"


class Flood:
    """A stand-in engine whose every answer is an endless stream of 16 KB events, written as
    fast as its socket takes them (uvicorn's flow control holds it back); counts what it sent
    and whether the stream was cancelled (its client, the gateway, left)."""

    def __init__(self) -> None:
        self.sent = 0
        self.cancelled = False

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return Response()

        async def models(request: Request) -> Response:
            return JSONResponse({"data": [{"id": MODEL, "owned_by": "vllm"}]})

        async def complete(request: Request) -> Response:
            await request.body()
            return StreamingResponse(self.events(), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/models", models),
                Route("/v1/chat/completions", complete, methods=["POST"]),
            ]
        )

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.sent += len(EVENT)
                yield EVENT
                await asyncio.sleep(0)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled = True
            raise


def test_a_client_that_stops_reading_stops_the_gateway_reading_the_engine(
    start_gateway: Callable[..., Served],
) -> None:
    flood = Flood()
    engine = start_app(flood.app())
    client = socket.socket()
    try:
        gateway = start_gateway([engine])
        body = (
            b'{"model":"%s","stream":true,"max_tokens":100000,'
            b'"messages":[{"role":"user","content":"go"}]}' % MODEL.encode()
        )
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", gateway.port))
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (TENANT_KEY.encode(), len(body), body)
        )
        assert client.recv(1024).startswith(b"HTTP/1.1 200")  # then the client reads no more
        pool = director(gateway).forwarder.pool
        assert pool is not None

        def engine_held_back() -> bool:
            return any(not c.transport.is_reading() for c in list(pool.connections) if c.transport)

        wait_until(engine_held_back, 20, "the gateway pausing the engine's socket")
        sent = flood.sent
        (upstream,) = list(pool.connections)
        assert upstream._buffered <= MAX_BUFFERED_BYTES + 256 * 1024
        (to_client,) = list(gateway.server.server_state.connections)
        assert to_client.transport.get_write_buffer_size() <= HIGH_WATER + 256 * 1024
        assert sent > 4 * (MAX_BUFFERED_BYTES + HIGH_WATER)  # the rest sits in the sockets
        client.close()  # the client leaves while the relay waits for it
        wait_until(lambda: flood.cancelled, 10, "the engine's stream cancelled")
        wait_until(lambda: director(gateway).replicas.get(engine.url).num_inflight == 0)
    finally:
        client.close()
        stop_all([engine])
