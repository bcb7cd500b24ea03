"""The raw engine connections (`gateway.pipeline.upstream`) against real loopback servers that
answer with exact bytes: keep-alive reuse, a stale connection replaced, every HTTP chunk of one
network read handed over as one block, a body delimited by the connection's end, a cut or
malformed response, and buffering bounded when nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.pipeline.upstream import MAX_BUFFERED_BYTES, UpstreamBroke, UpstreamPool, origin

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (it has a content-length: the pool always sends one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition the loop's callbacks make true (bounded)."""
    for _ in range(int(timeout_s / 0.001)):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {predicate}")


class Server:
    """A loopback server running `handler` per connection, counting the connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        server = Server(handler)
        listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
        servers.append(listening)
        server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/v1/x"
        return server

    yield start
    for listening in servers:
        listening.close()
        await listening.wait_closed()


async def test_a_connection_is_reused_and_a_stale_one_replaced(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    closing = asyncio.Event()
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            assert request.endswith(b'{"a":1}')
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"content-length: 2\r\n\r\n{}")
            await writer.drain()
            if closing.is_set():
                writer.close()  # the server drops the connection after this answer
                await writer.wait_closed()
                closed.set()
                return

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    for _ in range(3):
        conn = await pool.post(server.url, b'{"a":1}')
        assert (conn.status, conn.content_type, await conn.read()) == (
            200,
            "application/json",
            b"{}",
        )
        conn.release()
    assert server.num_connections == 1
    closing.set()
    conn = await pool.post(server.url, b'{"a":1}')
    assert await conn.read() == b"{}"
    conn.release()
    await closed.wait()  # whether or not its end has reached us yet: the next post works
    conn = await pool.post(server.url, b'{"a":1}')  # not the closed one: a new connection
    assert await conn.read() == b"{}"
    conn.release()
    assert server.num_connections == 2
    pool.close()


async def test_the_chunks_of_one_read_are_one_block_for_a_splice(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    go_on = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await go_on.wait()
        writer.write(chunk(b"data: 2\n\n") + chunk(b"data: 3\n\n") + chunk(b"data: 4\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert conn.status == 200 and conn.content_type == "text/event-stream"
    assert await conn.readany() == b"data: 1\n\n"
    blocks: list[bytes] = []
    go_on.set()
    await conn.splice(blocks.append)
    assert blocks == [b"data: 2\n\ndata: 3\n\ndata: 4\n\n"]
    assert await conn.readany() == b""  # the end, whole
    conn.release()
    pool.close()


async def test_a_body_delimited_by_the_connections_end_is_whole(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b"data: 1\n\ndata: [DONE]\n\n"
    conn.release()
    pool.close()


async def test_a_cut_or_malformed_response_fails_after_its_headers_and_before_them(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n") + b"40\r\ndata: 2")  # then gone
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 hello\r\n\r\n")
        await writer.drain()
        await reader.read()

    pool = UpstreamPool(8, 2.0)
    conn = await pool.post((await serve(cut)).url, b"{}")
    got = b""
    with pytest.raises(UpstreamBroke):
        while data := await conn.readany():
            got += data
    assert got == b"data: 1\n\ndata: 2"  # what arrived is passed on; then the break
    conn.release()
    with pytest.raises(ConnectionError):
        await pool.post((await serve(garbage)).url, b"{}")
    pool.close()


async def test_unread_body_bytes_stay_bounded_and_the_socket_is_paused(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    sent = 0
    event = b"data: " + b"x" * 16_000 + b"\n\n"

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(SSE_HEAD)
        while True:
            writer.write(chunk(event))
            sent += len(event)
            await writer.drain()

    pool = UpstreamPool(8, 2.0)
    conn = await pool.post((await serve(flood)).url, b"{}")
    assert conn.transport is not None
    transport = conn.transport
    await eventually(lambda: not transport.is_reading())
    buffered = conn._buffered
    assert MAX_BUFFERED_BYTES < buffered <= MAX_BUFFERED_BYTES + 256 * 1024
    for _ in range(50):  # a window in which nothing more may be buffered (the sockets are full)
        await asyncio.sleep(0.001)
    assert conn._buffered == buffered
    assert len(await conn.readany()) == buffered
    assert conn.transport.is_reading()  # a read resumes the socket
    conn.close()
    pool.close()


async def test_an_engine_ending_a_kept_alive_connection_is_reported(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    """Issue 45, item 17: an idle pooled connection the engine ends before its keep-alive ran
    out (a SIGKILL closes every socket of the process) is reported at once, so the replica
    becomes suspect before any request finds it restarted; ours closing one is not."""
    drop = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        writer.write(b"content-length: 2\r\n\r\n{}")
        await writer.drain()
        await drop.wait()  # then the engine dies: its socket closes

    server = await serve(answer)
    pool = UpstreamPool(8, 2.0)
    reported: list[tuple[str, int, bool]] = []
    pool.on_peer_closed = reported.append
    conn = await pool.post(server.url, b"{}")
    assert await conn.read() == b"{}"
    conn.release()  # idle in the pool
    assert reported == []
    drop.set()
    await eventually(lambda: bool(reported))
    assert reported == [origin(server.url)[:3]]
    conn = await pool.post(server.url, b"{}")  # a new connection: the pool has none idle
    pool.close()  # ours: not reported
    await eventually(lambda: not pool.connections)
    assert len(reported) == 1
